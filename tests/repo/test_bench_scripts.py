"""Every benchmark script under bench/ still imports against the package as it is now, and every runnable one
answers ``--help`` (the scripts are not run by the suite, so a moved module would otherwise go unnoticed until
someone runs a benchmark).

One fresh interpreter runs them all, each through ``runpy.run_path``: the runnable ones (``if __name__ ==
"__main__"``) as ``__main__`` with ``--help`` (module imports, then argument parsing, which exits 0), the others
(shared helpers) under a module name; it prints one JSON line of the failures."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from support import REPO_ROOT

BENCH = REPO_ROOT / "bench"
RUNNER = r"""
import contextlib, io, json, runpy, sys, traceback
bench, names = sys.argv[1], sys.argv[2:]
sys.path.insert(0, bench)
failures = {}
for name in names:
    path = f"{bench}/{name}"
    runnable = 'if __name__ == "__main__"' in open(path).read()
    sys.argv = [path, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__" if runnable else "bench_" + name[:-3])
        if runnable:
            failures[name] = "--help did not exit"
    except SystemExit as exc:
        if exc.code not in (0, None) or "usage:" not in out.getvalue():
            failures[name] = f"--help exited {exc.code!r}: {out.getvalue()[-300:]}"
    except BaseException:
        failures[name] = traceback.format_exc()[-1500:]
print(json.dumps(failures))
"""


def test_every_bench_script_imports_and_answers_help():
    names = sorted(p.name for p in BENCH.glob("*.py"))
    assert {"prefill.py", "serve_compare.py", "throughput.py", "common.py"} <= set(names)
    path = os.pathsep.join([str(REPO_ROOT / "service"), str(REPO_ROOT / "client"), os.environ.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", RUNNER, str(BENCH), *names], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}, cwd=REPO_ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    failures = json.loads(out.stdout.strip().splitlines()[-1])
    assert failures == {}, "\n\n".join(f"bench/{name}: {why}" for name, why in failures.items())
