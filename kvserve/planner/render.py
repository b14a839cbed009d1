"""Print sections as rich tables or as markdown."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kvserve.planner.sections import Section


def print_rich(sections: list[Section], console: Console | None = None) -> None:
    console = console or Console()
    for sec in sections:
        show_header = any(c for c in sec.columns)
        table = Table(
            title=sec.title,
            title_justify="left",
            show_header=show_header,
            caption=sec.caption,
            caption_justify="left",
        )
        for i, col in enumerate(sec.columns):
            table.add_column(
                col, justify="right" if i and show_header and _numeric(sec, i) else "left", overflow="fold"
            )
        for row in sec.rows:
            table.add_row(*row)
        console.print(table)


def _numeric(sec: Section, col: int) -> bool:
    cells = [r[col] for r in sec.rows if r[col]]
    return bool(cells) and all(c.replace(",", "").replace(".", "").replace("$", "").isdigit() for c in cells)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(sections: list[Section]) -> str:
    """GitHub-flavoured markdown: one ``###`` heading and one table per section."""
    lines: list[str] = []
    for sec in sections:
        lines.append(f"### {sec.title}")
        lines.append("")
        cols = [c or " " for c in sec.columns]
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("|" + "|".join("---" for _ in cols) + "|")
        for row in sec.rows:
            lines.append("| " + " | ".join(_md_cell(c) for c in row) + " |")
        if sec.caption:
            lines.extend(["", f"_{sec.caption}_"])
        lines.append("")
    return "\n".join(lines)
