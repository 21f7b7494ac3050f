"""The host row copy (``kvxfer/_rowcopy.c``, used through :class:`kvxfer.copies.HostRows`);
everything else is in pyproject.toml.

Built on CPython's limited API (one ``abi3`` wheel for every CPython >= 3.10), except on a
free-threaded CPython, which has no limited API."""

import sysconfig

from setuptools import Extension, setup

limited = not sysconfig.get_config_var("Py_GIL_DISABLED")

setup(
    ext_modules=[
        Extension(
            "kvxfer._rowcopy",
            ["kvxfer/_rowcopy.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-pthread"],
            extra_link_args=["-pthread"],
            define_macros=[("Py_LIMITED_API", "0x030A0000")] if limited else [],
            py_limited_api=limited,
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp310"}} if limited else {},
)
