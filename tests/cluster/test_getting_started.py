"""A newcomer's first hour, following only docs/getting-started.md: from the installed venv
(`make install` is what the suite's environment already did) to a run on two namespace hosts.

Every command comes from the page, in its order, with the page's own ``run with`` arguments
(`tests.support.docs_commands`); the hostfile is the page's. What the page asks of the machine
and not of dtrain is given as a newcomer's machine would have it: the venv activated
(`source .venv/bin/activate`), and SSH to the hosts without a prompt with their keys known
(``~/.ssh/config`` of a fresh ``HOME``: the namespace cluster's keys and known_hosts). Each
step's time is printed (``-s``) for the report.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from tests.support.docs_commands import ROOT, _code_lines, plans

PAGE = ROOT / "docs" / "getting-started.md"


def _hostfile_of_page() -> str:
    """The page's hostfile: the code block of ``host slots=N`` lines."""
    lines = [code for _, code in _code_lines(PAGE.read_text()) if " slots=" in code]
    assert lines, "docs/getting-started.md shows no hostfile"
    return "\n".join(lines) + "\n"


def _newcomers_env(home: Path) -> dict[str, str]:
    venv = Path(sys.executable).parent.parent
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "DTRAIN_"))}
    env.update(HOME=str(home), VIRTUAL_ENV=str(venv), OMP_NUM_THREADS="1",
               PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}")
    return env


def test_a_newcomer_gets_from_the_installed_venv_to_a_two_host_run_with_the_page_alone(
        cluster, tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    (home / ".ssh" / "config").write_text(cluster.ssh_config.read_text())
    work = tmp_path / "clone"
    work.mkdir()
    env = _newcomers_env(home)
    steps: list[tuple[str, float]] = []

    def step(name: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
        start = time.monotonic()
        done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True,
                              timeout=900, check=False)
        steps.append((name, time.monotonic() - start))
        assert done.returncode == 0, f"{name}: `{shlex.join(argv)}`\n{done.stdout[-2000:]}" \
                                     f"\n{done.stderr[-2000:]}"
        return done

    page = plans([PAGE])
    local = [p for p in page if p.mode == "run" and p.argv[:2] == ("dtrain", "launch")]
    check = next(p for p in page if p.command.argv()[:2] == ["dtrain", "check"])
    launch = next(p for p in page if p.mode == "dry-run")
    assert local and check.command.line < launch.command.line

    step("one machine, several ranks", list(local[0].argv))
    (work / "hostfiles").mkdir()
    (work / "hostfiles" / "cluster").write_text(_hostfile_of_page())
    step("dtrain check", check.command.argv())
    # The page's launch as written (its planned form drops --dry-run again).
    argv = [w for w in launch.argv if w != "--dry-run"]
    done = step("a first multi-host run", argv)

    out = done.stdout + done.stderr
    # The launcher's summary counts the ranks and hosts; rank 0 (node1) logs the steps.
    assert "dtrain: 8 ranks on 2 hosts exited 0" in out, out[-2000:]
    assert re.search(r"\[0@node1\] step +2 \|", out), out[-2000:]
    total = sum(seconds for _, seconds in steps)
    print("\nnewcomer's path (docs/getting-started.md): " + "; ".join(
        f"{name} {seconds:.1f} s" for name, seconds in steps) + f"; total {total:.1f} s")
