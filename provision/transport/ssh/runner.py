"""``BoundedRemote``: fabric's remote runner, except that the exec request is answered within a
bound (paramiko waits for that answer with no timeout; invoke's timeout starts only after it).
connect.py's fabric settings name it for every connection; run_on_all's groups use those connections.
"""

from __future__ import annotations

from fabric.runners import Remote

from provision.transport.ssh.channel import DEFAULT_CONNECT_TIMEOUT, answered_within


class BoundedRemote(Remote):  # type: ignore[misc]  # fabric ships no type information
    def send_start_message(self, command: str) -> None:
        wait_s = float(self.context.connect_kwargs.get("timeout") or DEFAULT_CONNECT_TIMEOUT) + 30
        answered_within(self.channel, lambda: self.channel.exec_command(command), wait_s)
