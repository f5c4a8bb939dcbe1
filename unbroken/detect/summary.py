"""Human-readable renderings of a report dict: Markdown (report.md) and rich tables (terminal).

Both render the same sections, built once by `sections`.
"""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

Section = tuple[str, list[str], list[list[str]]]   # title, headers, rows


def _f(x: Any, unit: str = "", digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}{unit}"
    return f"{x}{unit}"


def _pct(x: Any) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _overview(r: dict[str, Any]) -> Section:
    lat, split, fp_day = r["detection_latency_s"], r["time_split_s"], r["false_positives_per_day"]
    rows = [
        ["runs", str(len(r["runs"]))],
        ["wall time", _f(r["wall_s"], " s", 1)],
        ["productive time", _f(r["productive_s"], " s", 1)],
        ["ETTR (productive / wall)", _pct(r["ettr"])],
        ["faults (real)", str(sum(r["faults_by_class"].values()))],
        ["false positives", f"{r['false_positives']} ({_f(fp_day, '/day', 2)})"],
        ["injected but missed", str(r["missed"])],
        *([["injected but not fired", _not_fired(r)]] if "not_fired" in r else []),
        ["detection latency mean / median / max",
         f"{_f(lat['mean'], ' s')} / {_f(lat['median'], ' s')} / {_f(lat['max'], ' s')} (n={lat['count']})"],
        ["time to detect / diagnose / recover",
         f"{_f(split['detect'], ' s')} / {_f(split['diagnose'], ' s')} / {_f(split['recover'], ' s')}"],
        ["steps redone / lost", f"{r['steps_redone']} / {r['steps_lost']}"],
        ["excluded nodes", ", ".join(map(str, r["excluded_nodes"])) or "none"],
    ]
    return "Overview", ["measure", "value"], rows


def _not_fired(r: dict[str, Any]) -> str:
    """The count, then the specs (named with their run when there are several runs)."""
    many = len(r["runs"]) > 1
    specs = [f"{x['run']}: {x['fault']}" if many else x["fault"] for x in r["faults_not_fired"]]
    return f"{r['not_fired']} ({', '.join(specs)})" if specs else "0"


def _faults(r: dict[str, Any]) -> Section:
    many = len(r["runs"]) > 1   # name the run only when there is more than one
    rows = [([f["run"]] if many else []) + [
        _f(f["time_s"], "", 2), f["class"], _f(f["rank"]), _f(f["node"]), _f(f["detected_after_s"], " s"),
        _f(f["action"]), _f(f.get("shadow")), _f(f["recovered_s"], " s"), "FP" if f["false_positive"] else ""]
        for f in r["faults"]]
    headers = ["t (s)", "class", "rank", "node", "detected after", "action", "shadow", "recovered after", "FP"]
    return "Faults", (["run"] if many else []) + headers, rows


def _by_class(r: dict[str, Any]) -> Section:
    return "Faults by class", ["class", "count"], [[c, str(n)] for c, n in r["faults_by_class"].items()]


def _offenders(r: dict[str, Any]) -> Section:
    rows = [[str(o["node"]), str(o["faults"]), _pct(o["share"]),
             ", ".join(f"{c} {n}" for c, n in o["by_class"].items()) or "–",
             "excluded" if o["excluded"] else ""] for o in r["offenders"]]
    return "Per-node offenders", ["node", "faults", "share", "by class", "status"], rows


def _retries(r: dict[str, Any]) -> Section:
    t = r["retries"]
    return ("Automatic retry chains", ["chains", "links", "succeeded", "success rate"],
            [[str(t["chains"]), str(t["links"]), str(t["succeeded"]), _pct(t["success_rate"])]])


def _plans(r: dict[str, Any]) -> Section:
    rows = [[c["run"], _f(c["time_s"], " s", 1), str(c["seq"]), str(c["kind"]), str(c["split"]),
             ", ".join(c["congested"]) or "none"] for c in r.get("collective_plans", [])]
    return ("All-reduce re-plans (--collectives adaptive)", ["run", "at", "from collective", "pattern", "split",
                                                             "congested links"], rows)


def _runs(r: dict[str, Any]) -> Section:
    rows = [[x["run"], _f(x["wall_s"], " s", 1), _pct(x["ettr"]), str(x["steps"]), str(x["faults"]),
             str(x["false_positives"])] for x in r["runs"]]
    return "Runs", ["run", "wall", "ETTR", "steps", "detections", "false positives"], rows


def _pools(report: dict[str, Any]) -> Section:
    rows = [[f"{c['t']:.2f}", str(c["step"] if c["step"] is not None else "–"), str(c["rollout"]), str(c["train"]),
             str(c["train_gen"] if c["train_gen"] is not None else "–"), c["what"]] for c in report["pools"]]
    return "Pool sizes over time", ["t (s)", "step", "rollout", "train", "train gen", "change"], rows


def sections(report: dict[str, Any]) -> list[Section]:
    out = [_overview(report), _by_class(report), _faults(report), _offenders(report), _retries(report),
           _plans(report)]
    if len(report["runs"]) > 1:
        out.append(_runs(report))
    if report.get("pools"):
        out.append(_pools(report))
    return [s for s in out if s[2]]


def to_markdown(report: dict[str, Any], *, timeline: str | None = "timeline.png") -> str:
    lines = ["# unbroken operational report", ""]
    if timeline:
        lines += [f"![timeline: ranks x time, faults and recoveries marked]({timeline})", ""]
    for title, headers, rows in sections(report):
        lines += [f"## {title}", "", "| " + " | ".join(headers) + " |",
                  "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
        lines.append("")
    return "\n".join(lines)


def print_rich(report: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    for title, headers, rows in sections(report):
        table = Table(title=title, title_justify="left")
        for h in headers:
            table.add_column(h)
        for row in rows:
            table.add_row(*row)
        console.print(table)
