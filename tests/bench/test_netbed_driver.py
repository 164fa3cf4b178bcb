"""`bench.netbed_driver.BedDriver` against a small real program (no bed needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.netbed_driver import BedDriver

ECHO = r"""
import json, sys
print("[ray] a node died", flush=True)   # not JSON: skipped
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    msg = json.loads(line) if line.startswith("{") else {"raw": line.strip()}
    if msg.get("quiet"):
        continue                          # no answer: the caller's timeout
    if msg.get("exit"):
        print("bye", file=sys.stderr, flush=True)
        sys.exit(3)
    print("noise", flush=True)
    print(json.dumps({"got": msg}), flush=True)
"""


@pytest.fixture
def driver(tmp_path):
    with open(tmp_path / "log", "w+") as log:
        proc = subprocess.Popen([sys.executable, "-c", ECHO], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log, text=True)
        yield BedDriver(proc, log, timeout_s=10)
        proc.kill()
        proc.wait()


def test_answers_skip_lines_that_are_not_json(driver):
    assert driver.read() == {"ready": True}
    assert driver.ask(count=True) == {"got": {"count": True}}
    assert driver.send("next") == {"got": {"raw": "next"}}


def test_an_exited_driver_raises_with_its_log(driver):
    driver.read()
    with pytest.raises(RuntimeError, match=r"exited 3:\nbye"):
        driver.ask(exit=True)
    with pytest.raises(RuntimeError, match="exited 3"):  # and stays ended
        driver.read()


def test_no_answer_within_the_timeout_raises(driver):
    driver.read()
    driver.timeout_s = 0.3
    with pytest.raises(RuntimeError, match="no answer in 0 s"):
        driver.ask(quiet=True)
