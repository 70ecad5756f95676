"""systemd units as plain data: render them, quote command lines for them, check them with systemd-analyze.

A unit is three sections of (key, value) pairs kept in order; `render` writes the INI text systemd reads.
`exec_line` quotes an argv for ExecStart=: `%` and `$` are doubled (systemd expands specifiers and
variables there), and words holding spaces, quotes or backslashes are double-quoted with C escapes.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

Section = tuple[tuple[str, str], ...]
_SAFE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789@%+=:,./-_${}")


@dataclass(frozen=True)
class Unit:
    description: str
    exec_start: str
    user: str
    environment_file: Path
    working_directory: Path
    exec_start_post: str | None = None
    documentation: str | None = None
    restart_sec: int = 10
    start_limit_interval_sec: int = 600
    start_limit_burst: int = 5
    timeout_start_sec: int = 660
    timeout_stop_sec: int = 45
    limit_nofile: int = 65536
    syslog_identifier: str = "specserve"
    extra_service: Section = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.user or self.user == "root":
            raise ValueError("--user must name a dedicated unprivileged account, not root")
        for name in ("restart_sec", "timeout_start_sec", "timeout_stop_sec", "start_limit_burst"):
            if getattr(self, name) < 1:
                raise ValueError(f"systemd unit: {name} must be >= 1, got {getattr(self, name)}")
        if not self.environment_file.is_absolute() or not self.working_directory.is_absolute():
            raise ValueError("systemd unit: EnvironmentFile and WorkingDirectory must be absolute paths")

    def sections(self) -> dict[str, Section]:
        unit: list[tuple[str, str]] = [("Description", self.description)]
        if self.documentation:
            unit.append(("Documentation", self.documentation))
        unit += [("After", "network-online.target"), ("Wants", "network-online.target"),
                 ("StartLimitIntervalSec", str(self.start_limit_interval_sec)),
                 ("StartLimitBurst", str(self.start_limit_burst))]
        service: list[tuple[str, str]] = [
            ("Type", "simple"), ("User", self.user), ("Group", self.user),
            ("EnvironmentFile", str(self.environment_file)), ("WorkingDirectory", str(self.working_directory)),
            ("ExecStart", self.exec_start),
        ]
        if self.exec_start_post:
            service.append(("ExecStartPost", self.exec_start_post))
        service += [
            ("TimeoutStartSec", str(self.timeout_start_sec)),
            ("Restart", "on-failure"), ("RestartSec", str(self.restart_sec)),
            ("KillSignal", "SIGTERM"), ("TimeoutStopSec", str(self.timeout_stop_sec)),
            ("LimitNOFILE", str(self.limit_nofile)),
            ("StandardOutput", "journal"), ("StandardError", "journal"),
            ("SyslogIdentifier", self.syslog_identifier),
            ("NoNewPrivileges", "yes"), ("PrivateTmp", "yes"), ("ProtectSystem", "full"),
            *self.extra_service,
        ]
        return {"Unit": tuple(unit), "Service": tuple(service), "Install": (("WantedBy", "multi-user.target"),)}


def render(unit: Unit, header: str = "") -> str:
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for name, entries in unit.sections().items():
        if lines:
            lines.append("")
        lines.append(f"[{name}]")
        lines += [f"{key}={value}" for key, value in entries]
    return "\n".join(lines) + "\n"


def quote_word(word: str) -> str:
    """One argv word as systemd's ExecStart= parser reads it back."""
    escaped = word.replace("%", "%%").replace("$", "$$")
    if escaped and set(escaped) <= _SAFE:
        return escaped
    escaped = escaped.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def exec_line(argv: Sequence[str], variables: Sequence[str] = ()) -> str:
    """ExecStart= text for `argv`; words listed in `variables` (e.g. `${API_KEY}`) are left for systemd to expand."""
    return " ".join(word if word in variables else quote_word(word) for word in argv)


def analyze_unit(path: Path, timeout: float = 60.0) -> list[str]:
    """What `systemd-analyze verify` says about the unit file: [] when it accepts it.

    systemd-analyze exits 0 on unknown keys and unparsable values (it only logs them), so every line it
    prints about this file counts as a problem, as does a non-zero exit.
    """
    tool = shutil.which("systemd-analyze")
    if tool is None:
        raise FileNotFoundError("systemd-analyze is not installed; cannot verify the unit")
    proc = subprocess.run([tool, "verify", str(path)], capture_output=True, text=True, timeout=timeout, check=False)
    problems = [line for line in (proc.stdout + proc.stderr).splitlines() if path.name in line]
    if proc.returncode != 0 and not problems:
        problems.append(f"systemd-analyze verify exited {proc.returncode}: {proc.stderr.strip()[:300]}")
    return problems
