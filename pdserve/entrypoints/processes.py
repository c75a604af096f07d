"""The processes `pdserve up` runs (nodes, routers, its redis-server): each started with the
command that starts it again, restarted when it dies, and stopped together."""
from __future__ import annotations

import ctypes
import logging
import signal
import subprocess
import time

log = logging.getLogger(__name__)
MAX_RESTARTS_PER_MIN = 5
STOP_DEADLINE_S = 10  # SIGTERM, then SIGKILL for what has not exited by then
KILL_WAIT_S = 10  # then wait this long for each killed process to exit


def _die_with_parent() -> None:
    # Linux: a node gets SIGTERM if `pdserve up` dies without cleaning up.
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _kill_and_reap(name: str, proc: subprocess.Popen) -> None:
    """SIGKILL, then wait for the exit: a node with gigabytes mapped takes a moment to die, and
    `up` returning first left it running, orphaned, past its launcher's exit."""
    proc.kill()
    try:
        proc.wait(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        log.warning("%s did not exit %d s after SIGKILL", name, KILL_WAIT_S)


class ProcessSupervisor:
    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.commands: dict[str, tuple[list[str], dict]] = {}  # name -> how to start it again
        self.restarts: dict[str, list[float]] = {}  # name -> monotonic times it was restarted

    def launch(self, name: str, cmd: list[str], env: dict) -> None:
        self.commands[name] = (cmd, env)
        self.procs.append((name, subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)))

    def check_alive(self) -> None:
        """A node, Redis or the router that dies is restarted with the same command and ports (the
        router routes around a dead node meanwhile, and it rejoins on its first pong; a restarted
        router finds the nodes in the registry); one that keeps dying is restarted at most
        MAX_RESTARTS_PER_MIN times a minute, and a router that keeps dying stops the cluster."""
        for i, (name, proc) in enumerate(self.procs):
            if proc.poll() is None:
                continue
            now = time.monotonic()
            recent = [t for t in self.restarts.get(name, []) if now - t < 60]
            if len(recent) >= MAX_RESTARTS_PER_MIN:
                if name.startswith("router"):
                    raise RuntimeError(f"{name} exited with code {proc.returncode}, "
                                       f"{len(recent)} times within a minute")
                continue
            log.error("%s exited with code %s: restarting it (restart %d)", name, proc.returncode,
                      len(self.restarts.get(name, [])) + 1)
            cmd, env = self.commands[name]
            self.procs[i] = (name, subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent))
            self.restarts[name] = recent + [now]

    def stop_process(self, name: str) -> None:
        """SIGTERM `name`'s process and forget it, so it is not restarted."""
        self.commands.pop(name, None)
        for entry in [p for p in self.procs if p[0] == name]:
            self.procs.remove(entry)
            _, proc = entry
            proc.terminate()
            try:
                proc.wait(timeout=STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop_processes(self) -> None:
        """SIGTERM every process at once, then wait for them together."""
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_DEADLINE_S
        for name, proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop: killing it", name)
                _kill_and_reap(name, proc)
