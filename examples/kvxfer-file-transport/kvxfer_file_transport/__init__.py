"""kvxfer-file-transport: an example third-party kvxfer transport (entry point ``file_debug``).

It moves KV chunks through files, which makes every transfer visible on disk while
debugging, and it shows the *server-driven* style with per-request parameters:

* store: the client gathers the request's rows into a private spool file (0600, in a 0700
  directory it names at registration); the server reads the file into the arena slots;
* retrieve: the server writes the slots' rows into the spool file; the client reads it and
  scatters the rows of the chunks that were loaded into its blocks.

It imports only ``kvxfer`` and ``kvxfer.transport``, like any third-party plugin must.
"""

from importlib.metadata import version

from kvxfer_file_transport.transport import FileContext, FileParams, FileRegistration, FileServerContext, FileTransport

__all__ = ["FileTransport", "FileContext", "FileServerContext", "FileParams", "FileRegistration"]
__version__ = version("kvxfer-file-transport")  # defined once, in pyproject.toml
