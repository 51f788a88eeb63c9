"""Which address a rank shows the other ranks, and named errors when they cannot meet.

Left alone, gloo advertises the address the host name resolves to. In most containers and on
Debian/Ubuntu hosts that is 127.0.0.1, so ranks on other hosts are told to connect to their own
loopback and the job never forms. Instead every rank takes the interface that routes to
MASTER_ADDR (the one address every rank is known to reach), unless the user named one
(`--dist-interface`, or GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME), and uses it for gloo, for NCCL's
bootstrap and for the ZMQ sockets between the engine cores and the front end.

Before the process groups form, the ranks meet in torchrun's key-value store: each publishes its
address and network identity, and waits for the others for a bounded time. So an unreachable
master, a wrong interface and a node that never joins each end every rank with a message that says
what was tried, what failed and what to set, instead of a hang or a bare gloo trace.
"""
from __future__ import annotations

import errno
import ipaddress
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import Mapping, MutableMapping

import psutil

log = logging.getLogger("moe_serve.network")

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class DistNetworkError(RuntimeError):
    """The ranks cannot form a job; the message says what was tried, what failed and what to set."""


@dataclass(frozen=True)
class Endpoint:
    interface: str
    address: str
    why: str

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.address.split("%")[0]).is_loopback


def interface_table() -> dict[str, list[str]]:
    """{interface: its addresses}, IPv4 first, then IPv6 other than link-local (which needs a scope
    to be reached and so cannot be advertised as it is)."""
    table: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        v4 = [a.address for a in addrs if a.family == socket.AF_INET]
        v6 = [a.address for a in addrs if a.family == socket.AF_INET6 and not a.address.lower().startswith("fe80")]
        if v4 or v6:
            table[name] = v4 + v6
    return table


def describe(table: Mapping[str, list[str]]) -> str:
    return ", ".join(f"{name} ({', '.join(addrs)})" for name, addrs in sorted(table.items())) or "none"


def resolve(host: str) -> list[tuple[int, str]]:
    """(family, address) of every address `host` resolves to, IPv4 first."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise DistNetworkError(f"MASTER_ADDR={host!r} does not resolve on this host ({e.strerror}): give node 0's "
                               "address as an IP (--master-addr) or fix the name") from None
    out = []
    for fam, _, _, _, sa in sorted(infos, key=lambda i: i[0] != socket.AF_INET):
        if (fam, sa[0]) not in out:
            out.append((fam, sa[0]))
    return out


def source_address(host: str, port: int) -> str:
    """The local address the kernel's routing table picks for packets to host:port (a UDP
    `connect` sends nothing)."""
    errors = []
    for fam, addr in resolve(host):
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            try:
                s.connect((addr, port))
                return s.getsockname()[0]
            except OSError as e:
                errors.append(f"{addr}: {e.strerror}")
    raise DistNetworkError(f"no route from this host to MASTER_ADDR={host} ({'; '.join(errors)}): check "
                           "--master-addr, or name the interface that reaches node 0 with --dist-interface")


def interface_of(address: str, table: Mapping[str, list[str]]) -> str | None:
    want = ipaddress.ip_address(address.split("%")[0])
    for name, addrs in table.items():
        if any(ipaddress.ip_address(a.split("%")[0]) == want for a in addrs):
            return name
    return None


def choose_endpoint(master_addr: str, master_port: int, interface: str | None = None,
                    env: Mapping[str, str] = os.environ) -> Endpoint:
    """The interface and address this rank uses to reach the others, and why.

    Order: `interface` (the --dist-interface flag), then GLOO_SOCKET_IFNAME as the user set it
    (its first name), then the interface whose address the route to MASTER_ADDR leaves from."""
    table = interface_table()
    if interface is not None or env.get("GLOO_SOCKET_IFNAME"):
        name, why = ((interface, "--dist-interface names it") if interface is not None else
                     (env["GLOO_SOCKET_IFNAME"].split(",")[0].strip(), "GLOO_SOCKET_IFNAME (set by the user) names it"))
        if name not in table:
            flag = "--dist-interface" if interface is not None else "GLOO_SOCKET_IFNAME"
            raise DistNetworkError(f"{flag}={name}: this host has no interface of that name with an address; it has "
                                   f"{describe(table)}")
        return Endpoint(name, table[name][0], why)
    src = source_address(master_addr, master_port)
    name = interface_of(src, table)
    if name is None:  # the route's source address is on no interface we can list (seen in some sandboxes)
        raise DistNetworkError(f"the route to MASTER_ADDR={master_addr} leaves from {src}, which is on no interface "
                               f"of this host ({describe(table)}): name one with --dist-interface")
    own = any(a == src for _, a in resolve(master_addr))
    why = f"MASTER_ADDR {master_addr} is this host's own address" if own else f"it routes to MASTER_ADDR {master_addr}"
    return Endpoint(name, src, why)


def apply(ep: Endpoint, env: MutableMapping[str, str] = os.environ) -> list[str]:
    """Point gloo and NCCL at the endpoint's interface (the flag replaces what the user set; the
    automatic choice does not). Returns a line per variable saying what it is now and why."""
    lines = []
    for var in IFNAME_VARS:
        old = env.get(var)
        if old and not ep.why.startswith("--dist-interface"):
            lines.append(f"{var}={old} (set by the user)")
            continue
        if old and old != ep.interface:
            lines.append(f"{var}={ep.interface} (--dist-interface replaces the user's {old})")
        else:
            lines.append(f"{var}={ep.interface}")
        env[var] = ep.interface
    return lines


def url(address: str, port: int) -> str:
    """A ZMQ TCP address (IPv6 in brackets)."""
    return f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"


def _failure(e: OSError, ep: Endpoint | None = None, addr: str = "") -> str:
    if ep is not None and e.errno in (errno.EADDRNOTAVAIL, errno.EINVAL, errno.ENETUNREACH):
        return f"{ep.interface}'s address {ep.address} cannot send to {addr} ({e.strerror}): that interface does not " \
               f"reach node 0"
    if isinstance(e, socket.timeout):
        return "no answer (timed out)"
    if e.errno == errno.ECONNREFUSED:
        return "connection refused (the host answers, but nothing listens on that port yet)"
    return e.strerror or str(e)


def wait_reachable(master_addr: str, master_port: int, ep: Endpoint, timeout_s: float) -> float:
    """Open a TCP connection from the endpoint's address to MASTER_ADDR:MASTER_PORT (the job's
    key-value store), retrying until `timeout_s`; returns the seconds it took. Raises
    DistNetworkError naming what was tried when it never succeeds."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    warned = False
    targets = resolve(master_addr)
    while True:
        last = None
        for fam, addr in targets:
            try:
                with socket.socket(fam, socket.SOCK_STREAM) as s:
                    s.settimeout(max(0.2, min(3.0, deadline - time.monotonic())))
                    if (fam == socket.AF_INET6) == (":" in ep.address):  # leave from the chosen address
                        s.bind((ep.address, 0))
                    s.connect((addr, master_port))
                    return time.monotonic() - t0
            except OSError as e:
                last = (addr, e)
        assert last is not None
        addr, e = last
        if e.errno in (errno.EADDRNOTAVAIL, errno.EINVAL, errno.EAFNOSUPPORT) or time.monotonic() >= deadline:
            raise DistNetworkError(
                f"cannot reach the job's store at MASTER_ADDR {master_addr}:{master_port} ({addr}) from {ep.address} on "
                f"{ep.interface} (chosen because {ep.why}): {_failure(e, ep, addr)}, for {time.monotonic() - t0:.0f}s. "
                f"Check that node 0 is started and that --master-addr is its address as this host reaches it, that "
                f"--master-port is the same on every node, and that no firewall blocks it; on a host with several "
                f"interfaces name the one that reaches node 0 with --dist-interface (this host has "
                f"{describe(interface_table())})")
        if not warned:
            log.warning("cannot reach MASTER_ADDR %s:%d from %s (%s) yet: %s; retrying for %.0fs", master_addr,
                        master_port, ep.address, ep.interface, _failure(e), deadline - time.monotonic())
            warned = True
        time.sleep(0.5)


def network_identity() -> str:
    """Equal for two processes exactly when they share a network stack (one kernel, one network
    namespace): only then can one reach the other on a loopback address."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return socket.gethostname()


def meet(store, rank: int, world_size: int, node_rank: int, ep: Endpoint, timeout_s: float,
         prefix: str = "moe_serve/net") -> list[dict]:
    """Publish this rank's endpoint in the job's store and wait for every rank's; returns them in
    rank order. Raises DistNetworkError naming the ranks that did not join in time, or the ranks
    that advertise a loopback address to ranks on another host."""
    me = dict(asdict(ep), node=node_rank, netns=network_identity(), host=socket.gethostname())
    store.set(f"{prefix}/{rank}", json.dumps(me))
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    next_note = t0 + 10
    while True:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if not missing:
            break
        now = time.monotonic()
        if now >= deadline:
            raise DistNetworkError(
                f"rank{'s' if len(missing) > 1 else ''} {_ranks(missing)} did not join within {timeout_s:.0f}s "
                f"(this is rank {rank} on node {node_rank}, {ep.address} on {ep.interface}): start torchrun on every "
                f"node with the same --nnodes, --nproc-per-node, --master-addr and --master-port, or raise "
                f"--dist-join-timeout if a node starts later")
        if now >= next_note:
            log.info("waiting for rank%s %s to join (%.0fs of %.0fs)", "s" if len(missing) > 1 else "",
                     _ranks(missing), now - t0, timeout_s)
            next_note = now + 10
        time.sleep(0.1)
    peers = [json.loads(store.get(k)) for k in keys]
    stacks = {p["netns"] for p in peers}
    if len(stacks) > 1:
        loop = [r for r, p in enumerate(peers) if Endpoint(p["interface"], p["address"], p["why"]).loopback]
        if loop:
            raise DistNetworkError(
                f"rank{'s' if len(loop) > 1 else ''} {_ranks(loop)} would advertise a loopback address "
                f"({', '.join(sorted({peers[r]['address'] + ' on ' + peers[r]['interface'] for r in loop}))}) to ranks "
                f"on other hosts, which cannot reach it. On those hosts set --dist-interface (or GLOO_SOCKET_IFNAME) "
                f"to the interface that reaches the other nodes, or give --master-addr as node 0's network address, "
                f"not a loopback one")
    return peers


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def table_of(peers: list[dict]) -> str:
    return "; ".join(f"rank {r}: {p['address']} on {p['interface']} (node {p['node']})" for r, p in enumerate(peers))
