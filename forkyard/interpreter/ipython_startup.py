"""Run by every Python kernel at start (``--IPKernelApp.exec_files``), in the user's namespace.

Registers two extra representations, without importing pandas or matplotlib (types are matched by
module and name, so an idle kernel stays small): a DataFrame's table (the SDKs' ``Result.data``)
and the chart data ``e2b_charts`` extracts from a matplotlib figure (``Result.chart``; the inline
backend displays each figure, which runs every formatter). Our formatters match by class name
themselves: matplotlib_inline removes every formatter's Figure printer when it activates (at the
first pyplot import, mid-cell), so a registered printer would miss that cell's figures.
Everything is defined inside a function so the user's namespace gets no names from here.
"""


def __forkyard_register_formats() -> None:
    import json

    from IPython import get_ipython
    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    shell = get_ipython()
    if shell is None:
        return

    def dataframe_table(frame):  # type: ignore[no-untyped-def]
        return json.loads(frame.to_json(orient="split", date_format="iso", default_handler=str))

    def figure_chart(figure):  # type: ignore[no-untyped-def]
        from e2b_charts import chart_figure_to_dict

        return json.loads(json.dumps(chart_figure_to_dict(figure), default=str))

    class ByNameFormatter(BaseFormatter):
        """A JSON representation for classes named (module, name), their subclasses too."""

        format_type = Unicode("")
        print_method = ObjectName("_repr_forkyard_none_")

        def __init__(self, printers, **kwargs):  # type: ignore[no-untyped-def]
            super().__init__(**kwargs)
            self.by_name = printers

        def __call__(self, obj):  # type: ignore[no-untyped-def]
            for cls in type(obj).__mro__:
                printer = self.by_name.get((cls.__module__, cls.__name__))
                if printer is not None:
                    try:
                        value = printer(obj)
                    except Exception:  # e.g. a figure e2b_charts cannot read: still shown as PNG
                        return None
                    return value if isinstance(value, dict) else None
            return None

    formatters = shell.display_formatter.formatters
    tables = {(module, "DataFrame"): dataframe_table for module in ("pandas", "pandas.core.frame")}
    charts = {("matplotlib.figure", "Figure"): figure_chart}
    for mime, printers in (
        ("application/vnd.forkyard.data+json", tables),
        ("application/vnd.forkyard.chart+json", charts),
    ):
        formatters[mime] = ByNameFormatter(printers, parent=shell.display_formatter, format_type=mime)


def __forkyard_flush_only_when_written() -> None:
    """ipykernel flushes stdout and stderr several times per cell (after the cell, before the
    reply, before going idle), each a round trip to its IOPub thread that waits for it even when
    nothing was written: under gVisor those six waits were most of a ``1+1`` cell's time. A
    stream with nothing buffered has nothing to send, so its flush returns at once; a stream with
    output (or one that is not ipykernel's) flushes as before."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        if not hasattr(stream, "_buffers") or not hasattr(stream, "_flush_buffers"):
            continue  # not ipykernel's OutStream (or another version of it): left alone

        def flush(stream=stream, flush_through_io_thread=stream.flush):  # type: ignore[no-untyped-def]
            if stream._buffers or stream.echo is not None:
                flush_through_io_thread()

        stream.flush = flush  # type: ignore[method-assign]


def __forkyard_debugpy_importable_again() -> None:
    """The kernel's launcher hid debugpy from ipykernel (kernelspecs/forkyard-python/launch.py);
    a cell that imports it gets it."""
    import sys

    if "debugpy" in sys.modules and sys.modules["debugpy"] is None:
        del sys.modules["debugpy"]


__forkyard_register_formats()
__forkyard_flush_only_when_written()
__forkyard_debugpy_importable_again()
del __forkyard_register_formats, __forkyard_flush_only_when_written, __forkyard_debugpy_importable_again
