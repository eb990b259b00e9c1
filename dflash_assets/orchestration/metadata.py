"""Helpers that turn tables and numbers into Dagster metadata values."""

from __future__ import annotations

import base64

import dagster as dg
import polars as pl

_TYPES = {pl.Int64: "int", pl.Int32: "int", pl.Float64: "float", pl.Float32: "float", pl.Boolean: "bool"}


def table_preview(df: pl.DataFrame, max_rows: int = 10) -> dg.TableMetadataValue:
    """A Dagster table (shown as a table in the UI) of the first ``max_rows`` rows; other types as text."""
    head = df.head(max_rows)
    columns = [dg.TableColumn(name, _TYPES.get(dtype, "string")) for name, dtype in head.schema.items()]
    records = [
        dg.TableRecord({k: (v if head.schema[k] in _TYPES or v is None else str(v)) for k, v in row.items()})
        for row in head.iter_rows(named=True)
    ]
    return dg.MetadataValue.table(records, schema=dg.TableSchema(columns=columns))


def png_markdown(png: bytes, alt: str) -> dg.MarkdownMetadataValue:
    """Markdown metadata showing ``png`` inline in the Dagster UI: ``![alt](data:image/png;base64,...)``.

    The image travels base64-encoded inside the event log (about 4/3 of the PNG's bytes), so keep
    figures small (a 700x350 chart is tens of kB).
    """
    return dg.MetadataValue.md(f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})")
