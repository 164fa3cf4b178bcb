"""`make mutants`' report: the mutation score per area from mutmut's results under `mutants/`.

    python -m tests.mutation_score            # after `mutmut run`
    python -m tests.mutation_score --configure COPY/pyproject.toml --paths P... --tests T...
                                              # point a copy's [tool.mutmut] elsewhere (make mutants-engine)

Killed = a fast test failed (or timed out) with the mutant in place. Every mutant that was not
killed (survived, or no test reached it) must be listed in tests/MUTANTS.md as equivalent, with
one line of reason; the exit status is 1 if one is not, or if `cache_service/` scores below 90%.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

MUTANTS_DIR = Path("mutants")
LEDGER = Path("tests/MUTANTS.md")
TARGETS = {"cache_service/": 0.90}  # area -> the killed fraction it must reach
KILLED = {1: "killed", 3: "killed", 36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout",
          -11: "segfault", -9: "segfault"}  # mutmut's exit codes (mutmut.stats.status_by_exit_code)
NOT_KILLED = {0: "survived", 5: "no tests", 33: "no tests"}


def area_of(source: str) -> str:
    return "cache_service/" if source.startswith("cache_service/") else source


def load_results() -> dict[str, tuple[str, int | None]]:
    """mutant name -> (source file, exit code) for every mutant mutmut generated."""
    out = {}
    for meta in sorted(MUTANTS_DIR.rglob("*.py.meta")):
        source = meta.relative_to(MUTANTS_DIR).as_posix()[: -len(".meta")]
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            out[name] = (source, code)
    return out


def listed_equivalent() -> dict[str, str]:
    """`tests/MUTANTS.md` rows: | `mutant name` | reason |."""
    if not LEDGER.exists():
        return {}
    return dict(re.findall(r"^\|\s*`([^`]+)`\s*\|\s*(.+?)\s*\|\s*$", LEDGER.read_text(), flags=re.M))


def configure(pyproject: Path, paths: list[str], tests: list[str]) -> None:
    """Rewrite [tool.mutmut]'s source paths and test selection in a copy of the tree."""
    text = pyproject.read_text()
    for key, values in (("source_paths", paths), ("pytest_add_cli_args_test_selection", tests),
                        ("do_not_mutate", [])):
        text, n = re.subn(rf"^{key} = .*$", f"{key} = {json.dumps(values)}", text, flags=re.M)
        assert n == 1, f"{pyproject}: no `{key} = ...` line in [tool.mutmut]"
    pyproject.write_text(text)


def main() -> int:
    if "--configure" in sys.argv:
        args = sys.argv[sys.argv.index("--configure") + 1:]
        paths = args[args.index("--paths") + 1: args.index("--tests")]
        configure(Path(args[0]), paths, args[args.index("--tests") + 1:])
        return 0
    results = load_results()
    if not results:
        print("no mutmut results under mutants/: run `make mutants`", file=sys.stderr)
        return 1
    equivalent = listed_equivalent()
    ok = True
    by_area: dict[str, Counter] = {}
    unaccounted, unchecked = [], []
    for name, (source, code) in results.items():
        counts = by_area.setdefault(area_of(source), Counter())
        counts["total"] += 1
        if code in KILLED:
            counts["killed"] += 1
        elif code in NOT_KILLED:
            counts[NOT_KILLED[code]] += 1
            if name in equivalent:
                counts["equivalent"] += 1
            else:
                unaccounted.append(f"{NOT_KILLED[code]:9s} {name}")
        else:  # not checked (interrupted run), suspicious, skipped
            counts["unchecked"] += 1
            unchecked.append(f"exit {code} {name}")
    for area, c in sorted(by_area.items()):
        score = c["killed"] / c["total"]
        adjusted = c["killed"] / max(c["total"] - c["equivalent"], 1)
        target = TARGETS.get(area)
        line = (f"{area:36s} {c['killed']:5d} killed of {c['total']:5d} mutants = {score:6.1%}"
                f"   ({c['survived']} survived, {c['no tests']} reached by no test, {c['equivalent']} of those"
                f" listed equivalent; killed of non-equivalent {adjusted:.1%})")
        if target is not None and score < target:
            line += f"   BELOW the {target:.0%} target"
            ok = False
        print(line)
    stale = sorted(set(equivalent) - set(results))
    if stale:
        print(f"\n{len(stale)} mutants listed in {LEDGER} no longer exist (source changed): {stale[:5]}")
    if unchecked:
        ok = False
        print(f"\n{len(unchecked)} mutants not checked (an interrupted run?):", *unchecked[:20], sep="\n  ")
    if unaccounted:
        ok = False
        print(f"\n{len(unaccounted)} mutants not killed and not listed in {LEDGER} "
              "(`mutmut show NAME` shows one):", *unaccounted, sep="\n  ")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
