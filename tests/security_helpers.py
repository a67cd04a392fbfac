"""Shared by the security tests (tests/test_security_*.py): the unprivileged test user, one-line checks.

The permission checks run as the unprivileged user `taehvtest` (created here, or by scripts/setup.sh),
through `setpriv` with one capability, CAP_DAC_READ_SEARCH: it lets the process read the interpreter
wherever it is installed (e.g. under a 0700 /root) and nothing else; it cannot write, chown or chmod
what is not its own, so writes, ownership and our checks behave exactly as for any user.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO

TEST_USER = "taehvtest"


@dataclass
class User:
    """The unprivileged user, and a private temporary folder of its own."""

    name: str
    uid: int
    gid: int
    home: Path  # owned by the user, 0700, under the system's temporary folder

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
        """Run `argv` as the user (its own uid, gid and groups; no privilege but reading)."""
        environ = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.home), "LANG": "C.UTF-8",
                   "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
        command = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups",
                   "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", "--", *argv]
        return subprocess.run(command, env=environ, cwd=self.home, capture_output=True, text=True,
                              timeout=timeout)

    def python(self, code: str, *args: str | os.PathLike, env: Mapping[str, str] | None = None) -> Any:
        """Run `code` as the user; it prints one JSON value on its last line, returned here."""
        out = self.run([sys.executable, "-c", code, *map(str, args)], env)
        assert out.returncode == 0, f"as {self.name}: {out.stderr[-3000:]}"
        return json.loads(out.stdout.strip().splitlines()[-1])

    def chown(self, *paths: Path) -> None:
        """Hand `paths` (not what a symbolic link points to) to the user and its group."""
        for path in paths:
            os.chown(path, self.uid, self.gid, follow_symlinks=False)


def unprivileged_user(test_file: str) -> Iterator[User]:
    """The body of each security module's `user` fixture: the test user, with a fresh private home."""
    try:
        entry = pwd.getpwnam(TEST_USER)
    except KeyError:
        if os.geteuid() != 0:
            pytest.fail(f"user {TEST_USER} is missing: run `bash scripts/setup.sh` as root (it creates it)",
                        pytrace=False)
        subprocess.run(["useradd", "-m", TEST_USER], check=True, capture_output=True)
        entry = pwd.getpwnam(TEST_USER)
    if os.geteuid() != 0:
        pytest.fail(f"{test_file} switches to the test user: run it as root, as CI does", pytrace=False)
    home = Path(tempfile.mkdtemp(prefix="taehv-security-"))
    os.chown(home, entry.pw_uid, entry.pw_gid)
    who = User(TEST_USER, entry.pw_uid, entry.pw_gid, home)
    facts = who.python("import json, os; print(json.dumps([os.geteuid(), os.access('/', os.W_OK)]))")
    assert facts == [entry.pw_uid, False], f"not an unprivileged process: {facts}"
    try:
        yield who
    finally:
        shutil.rmtree(home, ignore_errors=True)


def one_line(message: str) -> str:
    """`message` without its surrounding whitespace, asserted to be one line."""
    assert message and "\n" not in message.strip(), f"not one line: {message!r}"
    return message.strip()


def mode(path: Path) -> int:
    """The permission bits of `path` itself (not of what a symbolic link points to)."""
    return stat.S_IMODE(path.lstat().st_mode)
