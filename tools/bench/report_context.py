"""What the benchmark report's sections read: the tools' JSONs, the manifest, where plots go.

Imported by `report.py`, which puts `tools/bench` on `sys.path`."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

from report_plots import save_png
from report_tools import (
    REPORT_KEY,
    TOOLS,
    Tool,
    _mtime,
    _rel,
    _tool,
    describe_machine,
    json_digest,
    load_json,
)


# ------------------------------------------------------------------------------------ markdown
@dataclass
class ReportContext:
    """What the sections read: the tools' JSONs, the manifest, where plots go."""

    json_dir: Path
    md_dir: Path
    png_dir: Path
    manifest: dict
    quick: bool
    strict: bool = True
    """Accept a JSON only if its manifest entry (run id + SHA-256) vouches for it. False only for
    building from bare JSONs programmatically (their sections then say "unknown machine")."""
    data: dict = field(default_factory=dict)
    reasons: dict = field(default_factory=dict)
    not_measured: dict = field(default_factory=dict)

    @property
    def run_id(self) -> str | None:
        """The report run this report belongs to (the latest that ran tools)."""
        return (self.manifest.get(REPORT_KEY) or {}).get("run_id")

    def load(self) -> None:
        for tool in TOOLS:
            entry = self.manifest.get(tool.name)
            path = self.json_dir / f"{tool.name}.json"
            if entry and entry.get("status") != "ok":
                self.data[tool.name] = None
                self.reasons[tool.name] = f"{entry.get('status')}: {entry.get('reason')}"
                continue
            why = self._unvouched(tool, entry, path) if self.strict else None
            if why is not None:
                self.data[tool.name], self.reasons[tool.name] = None, why
                continue
            self.data[tool.name], self.reasons[tool.name] = load_json(path)

    def _unvouched(self, tool: Tool, entry: dict | None, path: Path) -> str | None:
        """Why the JSON at `path` is not the output of a recorded run of `tool` (or None)."""
        if not path.is_file():
            return None  # load_json says "no JSON"
        again = f"rerun it: python tools/bench/report.py --tools {tool.name}"
        if not entry:
            return f"{_rel(path)} was not produced by a report run (no manifest entry); {again}"
        if not entry.get("json_sha256") or entry["json_sha256"] != json_digest(path):
            return (
                f"{_rel(path)} is not the JSON its run wrote (edited, replaced or hand-added: "
                f"its SHA-256 does not match the manifest); {again}"
            )
        return None

    def missing(self, name: str) -> str:
        """The "not measured" line of a tool (and its entry in the closing list)."""
        tool = _tool(name)
        who = f"`{tool.script}`" if not tool.stdout_json else f"`mecefo-sim {tool.args[0]}`"
        line = f"not measured: {who} ({tool.title}): {self.reasons.get(name) or 'no data'}"
        self.not_measured[name] = line
        return f"> {line}"

    def provenance(self, name: str) -> str:
        tool, entry = _tool(name), self.manifest.get(name) or {}
        json_path = self.json_dir / f"{name}.json"
        cmd = entry.get("command") or tool.display(self.quick, json_path)
        when = entry.get("started") or _mtime(json_path)
        wall = f", wall {entry['wall_s']:.0f} s" if entry.get("wall_s") else ""
        other = ""
        if self.run_id and entry.get("run_id") != self.run_id:
            run = entry.get("run_id") or "an unidentified earlier run"
            quick = " (--quick)" if entry.get("quick") else ""
            other = f"**From another run: `{run}`{quick}, not this report's run `{self.run_id}`.** "
        return (
            f"{other}*Measured on {describe_machine(entry.get('machine'))}, {when}{wall}. "
            f"Reproduce:* `{cmd}`"
        )

    def image(self, fig, filename: str, alt: str) -> str:
        path = self.png_dir / filename
        save_png(fig, path)
        return f"![{alt}]({os.path.relpath(path, self.md_dir)})"


def tool_section(name: str, provenance: bool = True):
    """A section drawn from tool `name`'s JSON alone: its "not measured" line when there is no
    JSON, else `render(ctx, data)` followed by the tool's provenance (`provenance=False`: the
    section places that line itself, e.g. before its plot)."""

    def wrap(render):
        @functools.wraps(render)
        def section(ctx: ReportContext) -> list[str]:
            data = ctx.data.get(name)
            if data is None:
                return [ctx.missing(name), ""]
            return render(ctx, data) + ([ctx.provenance(name), ""] if provenance else [])

        return section

    return wrap
