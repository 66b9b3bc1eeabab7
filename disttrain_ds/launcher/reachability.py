"""Are the hostfile's remote hosts there: one TCP probe per host (its ssh port), all at once.

A dead node is then one line naming its hostfile line, instead of an ssh error or a hang once
the ``deepspeed`` launcher has started.
"""

from __future__ import annotations

import socket
import threading
import time

from disttrain_ds.launcher.hostfile import Host


def local_names() -> frozenset[str]:
    """Names that mean this machine: no network check is needed for them."""
    names = {"localhost", "127.0.0.1", "::1"}
    for lookup in (socket.gethostname, socket.getfqdn):
        try:
            names.add(lookup())
        except OSError:
            pass
    return frozenset(names)


def probe(host: str, port: int, timeout: float) -> str | None:
    """None if ``host`` accepts a TCP connection on ``port`` within ``timeout`` s, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except socket.gaierror:
        return "does not resolve (check the name, DNS or /etc/hosts)"
    except TimeoutError:
        return f"is unreachable: no answer on port {port} within {timeout:g} s"
    except ConnectionRefusedError:
        return f"is unreachable: connection to port {port} refused (is sshd running there?)"
    except OSError as exc:
        return f"is unreachable: port {port}: {exc.strerror or exc}"


def unreachable(hosts: list[Host], *, port: int, timeout: float, local: frozenset[str] | None = None) -> dict[str, str]:
    """Probe every non-local host at once: host name -> why it did not answer, in hostfile order."""
    local = local_names() if local is None else local
    remote = [h for h in hosts if h.name not in local]
    results: dict[str, str | None] = {}

    def worker(host: Host) -> None:
        results[host.name] = probe(host.name, port, timeout)

    # daemon threads: a name lookup that hangs must not keep the process alive after we give up on it
    threads = [threading.Thread(target=worker, args=(h,), daemon=True) for h in remote]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 2 * timeout + 2  # connect timeout plus slack for name lookup
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    out = {}
    for h in remote:
        reason = results.get(h.name, f"is unreachable: no answer within {2 * timeout + 2:g} s (name lookup hung?)")
        if reason is not None:
            out[h.name] = reason
    return out


def check_reachability(
    hosts: list[Host], *, src: str, port: int, timeout: float, local: frozenset[str] | None = None
) -> list[str]:
    """Probe every non-local host at once; one message per host that failed, in hostfile order."""
    line = {h.name: h.line for h in hosts}
    return [f"{src}:{line[name]}: host '{name}' {reason}"
            for name, reason in unreachable(hosts, port=port, timeout=timeout, local=local).items()]
