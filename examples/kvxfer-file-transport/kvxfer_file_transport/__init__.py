"""kvxfer-file-transport: an example third-party kvxfer transport (entry point ``file_debug``).

It moves KV chunks through files, which makes every transfer visible on disk while
debugging, and it shows the *server-driven* style with per-request parameters:

* store: the client gathers the request's rows into a spool file; the server reads the file into
  the arena slots;
* retrieve: the server writes the loaded chunks' rows into a spool file; the client reads it and
  scatters them into its blocks.

The spool files live in a private directory (0700) that the server makes for each registration
next to its arena, under names the transport derives (``spool-<slot>``): no request names a path.
It is not meant for production (``production = False``): a server loads it only when it is
named in ``--transports``.

It imports only ``kvxfer`` and ``kvxfer.transport``, like any third-party plugin must.
"""

from importlib.metadata import version

from kvxfer_file_transport.transport import FileContext, FileParams, FileRegistration, FileServerContext, FileTransport

__all__ = ["FileTransport", "FileContext", "FileServerContext", "FileParams", "FileRegistration"]
__version__ = version("kvxfer-file-transport")  # defined once, in pyproject.toml
