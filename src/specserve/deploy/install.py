"""`specserve deploy install DIR [--dry-run]` and `specserve deploy status [DIR]`.

install, in order: re-check the frozen hashes (nothing is installed for a changed checkpoint), verify the
unit with systemd-analyze (when installed), create the service user when missing, copy the unit into
/etc/systemd/system, `systemctl daemon-reload`, `systemctl enable`, `systemctl restart` (starts it,
or replaces the running server when a previous deployment is re-installed). --dry-run prints the same list
and touches nothing. status: the unit's state from systemctl (when systemd runs), then the live
/health and /server_info (accept length) of the server.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from specserve.deploy.freeze import API_KEY_VAR, SERVICE, load_serve_config
from specserve.deploy.systemd import analyze_unit

SYSTEMD_DIR = Path("/etc/systemd/system")
Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def run_command(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    if shutil.which(argv[0]) is None:
        raise FileNotFoundError(f"{argv[0]} is not installed on this machine")
    return subprocess.run(list(argv), capture_output=True, text=True, check=False, timeout=300)


@dataclass(frozen=True)
class Action:
    kind: str  # verify | run | copy
    argv: tuple[str, ...] = ()
    src: Path | None = None
    dst: Path | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("verify", "run", "copy"):
            raise ValueError(f"unknown install action {self.kind!r}")

    def describe(self) -> str:
        if self.kind == "copy":
            return f"copy {self.src} -> {self.dst} (mode 0644)"
        if self.kind == "verify":
            return f"check: systemd-analyze verify {self.src}"
        return "run: " + " ".join(self.argv)


def read_facts(directory: Path) -> dict[str, Any]:
    path = directory / "deploy.json"
    if not path.is_file():
        raise ValueError(f"{directory}: no deploy.json; is this a `specserve deploy freeze` directory?")
    facts: dict[str, Any] = json.loads(path.read_text())
    return facts


def plan_install(directory: Path, systemd_dir: Path = SYSTEMD_DIR) -> list[Action]:
    facts = read_facts(directory)
    unit = directory / str(facts["unit"])
    for needed in (unit, directory / "serve.yaml", directory / f"{SERVICE}.env"):
        if not needed.is_file():
            raise ValueError(f"{directory}: {needed.name} is missing; freeze the configuration again")
    load_serve_config(directory / "serve.yaml")  # raises when a pinned file changed since the freeze
    actions: list[Action] = []
    if shutil.which("systemd-analyze"):
        actions.append(Action("verify", src=unit))
    user = str(facts["user"])
    try:
        pwd.getpwnam(user)
    except KeyError:
        actions.append(Action("run", ("useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                                      user)))
    actions += [Action("copy", src=unit, dst=systemd_dir / unit.name),
                Action("run", ("systemctl", "daemon-reload")),
                Action("run", ("systemctl", "enable", unit.name)),
                # restart, not `enable --now`: re-installing a directory (a rollback) must replace a running server
                Action("run", ("systemctl", "restart", unit.name))]
    return actions


def install(directory: Path, dry_run: bool = False, systemd_dir: Path = SYSTEMD_DIR,
            runner: Runner = run_command, out: Callable[[str], None] = print) -> None:
    """Carry out (or, with dry_run, only print) the install actions; raises RuntimeError on a failed step."""
    actions = plan_install(directory, systemd_dir)
    for action in actions:
        out(("[dry-run] " if dry_run else "") + action.describe())
        if dry_run:
            continue
        if action.kind == "verify":
            assert action.src is not None
            problems = analyze_unit(action.src)
            if problems:
                raise RuntimeError("systemd-analyze verify rejected the unit:\n" + "\n".join(problems))
        elif action.kind == "copy":
            assert action.src is not None and action.dst is not None
            action.dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(action.src, action.dst)
            os.chmod(action.dst, 0o644)
        else:
            proc = runner(action.argv)
            if proc.returncode != 0:
                raise RuntimeError(f"`{' '.join(action.argv)}` failed ({proc.returncode}): "
                                   f"{(proc.stderr or proc.stdout).strip()[:500]}")


def service_state(service: str, runner: Runner = run_command) -> dict[str, str]:
    """ActiveState, SubState, UnitFileState, NRestarts ... from `systemctl show`, or {"error": why not}."""
    keys = "ActiveState,SubState,UnitFileState,NRestarts,MainPID,ActiveEnterTimestamp"
    try:
        proc = runner(("systemctl", "show", f"{service}.service", "-p", keys))
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)}
    if proc.returncode != 0 or "=" not in proc.stdout:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[0] if (proc.stderr or proc.stdout)
                else f"systemctl exited {proc.returncode}"}
    return dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)


def live_state(base_url: str, api_key: str | None = None, timeout: float = 5.0) -> dict[str, Any]:
    """/health and, from /server_info, the speculative algorithm and the server's running accept length."""
    out: dict[str, Any] = {"url": base_url}
    try:
        r = httpx.get(f"{base_url}/health", timeout=timeout)
        out["health"] = "ok" if r.status_code == 200 else f"HTTP {r.status_code}"
    except httpx.HTTPError as e:
        out["health"] = f"unreachable ({type(e).__name__})"
        return out
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        info = httpx.get(f"{base_url}/server_info", headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        out["server_info"] = f"unreachable ({type(e).__name__})"
        return out
    if info.status_code != 200:
        out["server_info"] = f"HTTP {info.status_code}"
        return out
    data = info.json()
    spec = data.get("speculative") if isinstance(data.get("speculative"), dict) else {}
    out.update(algorithm=spec.get("algorithm"), accept_length=data.get("avg_spec_accept_length"),
               verify_steps=data.get("spec_cumulative_num_forward_ct"))
    return out


def _api_key(directory: Path | None) -> str | None:
    if os.environ.get(API_KEY_VAR):
        return os.environ[API_KEY_VAR]
    env = directory / f"{SERVICE}.env" if directory else None
    if env is not None and os.access(env, os.R_OK):
        for line in env.read_text().splitlines():
            if line.startswith(API_KEY_VAR + "="):
                return line.split("=", 1)[1]
    return None


def status(directory: Path | None = None, url: str | None = None, runner: Runner = run_command) -> dict[str, Any]:
    facts = read_facts(directory) if directory is not None else {}
    base = url or str(facts.get("health_url", "http://127.0.0.1:30000/health")).removesuffix("/health")
    service = str(facts.get("service", SERVICE))
    return {"service": service, "systemd": service_state(service, runner),
            "live": live_state(base.rstrip("/"), _api_key(directory))}


def format_status(st: dict[str, Any]) -> list[str]:
    sd, live = st["systemd"], st["live"]
    if "error" in sd:
        lines = [f"service {st['service']}: state unknown ({sd['error']})"]
    else:
        lines = [f"service {st['service']}: {sd.get('ActiveState')} ({sd.get('SubState')}), "
                 f"{sd.get('UnitFileState')}, restarts {sd.get('NRestarts')}, since {sd.get('ActiveEnterTimestamp')}"]
    lines.append(f"health {live['url']}/health: {live['health']}")
    if "accept_length" in live:
        accept = live["accept_length"]
        lines.append(f"speculative algorithm {live.get('algorithm')}: accept length "
                     f"{'-' if accept is None else format(accept, '.2f')} over {live.get('verify_steps') or 0} "
                     "verify steps since start")
    elif "server_info" in live:
        lines.append(f"server_info: {live['server_info']}")
    return lines
