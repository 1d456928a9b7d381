"""A network between two services on one machine: a TCP relay that delays each direction.

    python -m rsd_bench.netem --to 127.0.0.1:50051 --delay-ms 25 --jitter 0.1     # prints its address

Where the kernel has `tc netem` (network namespaces joined by a veth pair), that is the better emulation;
this relay is the knob in the transport for machines without it (no netem module, no root). Put it in
front of a service's port and hand its address to the clients instead of the service's: each chunk of
bytes read from one side is written to the other after a one-way delay of delay_ms x (1 + U(-jitter,
jitter)), in both directions. The link has no bandwidth limit and no loss; it keeps TCP's order: a chunk
leaves at max(arrival + its delay, the previous chunk's departure), so jitter never reorders bytes (as a
real link's queue would not). The delay can be changed while connections are open (set_delay); chunks
already queued keep theirs.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import threading
from dataclasses import dataclass

CHUNK = 1 << 16


def departure(arrival: float, delay: float, previous: float) -> float:
    """When a chunk that arrived at `arrival` leaves: after its delay, never before the chunk ahead of it."""
    return max(arrival + delay, previous)


@dataclass
class LinkStats:
    """Per direction (up = client -> service): chunks and bytes relayed, and the delay they were given."""

    chunks: int = 0
    bytes: int = 0
    delay_s: float = 0.0  # sum of departure - arrival (the applied one-way delay, queueing behind a chunk included)

    def as_dict(self) -> dict:
        return {
            "chunks": self.chunks,
            "bytes": self.bytes,
            "mean_delay_ms": round(1000 * self.delay_s / self.chunks, 3) if self.chunks else None,
        }


class DelayRelay:
    """Listens on host:port (0 = a free one) and relays every connection to `target` ("host:port") with a
    one-way delay each way. start() runs it on an event loop in a thread of its own and returns its address."""

    def __init__(self, target: str, delay_ms: float = 0.0, jitter: float = 0.1, seed: int = 0, host: str = "127.0.0.1"):
        if not 0 <= jitter < 1:
            raise ValueError(f"jitter is a fraction of the delay in [0, 1), got {jitter}")
        self.target_host, _, port = target.rpartition(":")
        self.target_port = int(port)
        self.host, self.delay_ms, self.jitter = host, float(delay_ms), jitter
        self.rng = random.Random(seed)
        self.stats = {"up": LinkStats(), "down": LinkStats()}
        self.connections = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self.address = ""

    def set_delay(self, delay_ms: float, jitter: float | None = None) -> None:
        """Applies to chunks that arrive from now on (the loop reads these between chunks)."""
        self.delay_ms = float(delay_ms)
        if jitter is not None:
            self.jitter = jitter

    def reset_stats(self) -> None:
        self.stats = {"up": LinkStats(), "down": LinkStats()}

    def _delay_s(self) -> float:
        return self.delay_ms / 1000 * (1 + self.rng.uniform(-self.jitter, self.jitter))

    # -- the loop's side

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def receive() -> None:
            previous = 0.0
            try:
                while True:
                    data = await reader.read(CHUNK)
                    arrival = loop.time()
                    previous = departure(arrival, self._delay_s(), previous)  # the end of the stream travels too
                    if data:
                        stats = self.stats[direction]
                        stats.chunks, stats.bytes = stats.chunks + 1, stats.bytes + len(data)
                        stats.delay_s += previous - arrival
                    await queue.put((previous, data))
                    if not data:
                        return
            except (ConnectionError, OSError):
                await queue.put((previous, b""))

        async def send() -> None:
            try:
                while True:
                    leave, data = await queue.get()
                    await asyncio.sleep(max(0.0, leave - loop.time()))
                    if not data:
                        if writer.can_write_eof():
                            writer.write_eof()
                        return
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass

        await asyncio.gather(receive(), send())

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            service_reader, service_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            client_writer.close()
            return
        try:
            await asyncio.gather(
                self._pipe(client_reader, service_writer, "up"), self._pipe(service_reader, client_writer, "down")
            )
        except asyncio.CancelledError:  # stop(): end quietly (asyncio's stream callback reports a cancelled handler)
            pass
        finally:
            for w in (service_writer, client_writer):
                w.close()

    async def _serve(self, port: int, ready: threading.Event) -> None:
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._handle, self.host, port)
        self.address = f"{self.host}:{server.sockets[0].getsockname()[1]}"
        ready.set()
        await self._stopping.wait()
        server.close()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:  # the open connections
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await server.wait_closed()

    # -- the caller's side

    def start(self, port: int = 0) -> str:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=lambda: self._loop.run_until_complete(self._serve(port, ready)), name="netem-relay", daemon=True
        )
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the relay did not start listening")
        return self.address

    def stop(self) -> None:
        """Closes the listener and every open connection."""
        if self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(10)
        self._loop.close()
        self._loop = None

    def describe(self) -> dict:
        """What the benchmark records: which emulation, and what the link did."""
        return {
            "emulation": "userspace TCP relay (rsd_bench.netem)",
            "delay_ms": self.delay_ms,
            "jitter": self.jitter,
            "connections": self.connections,
            **{direction: s.as_dict() for direction, s in self.stats.items()},
        }

    def __enter__(self) -> DelayRelay:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rsd_bench.netem", description=__doc__.split("\n")[0])
    ap.add_argument("--to", required=True, help="the service's host:port")
    ap.add_argument("--listen", default="127.0.0.1:0", help="host:port to listen on (port 0: a free one)")
    ap.add_argument("--delay-ms", type=float, default=10.0, help="one-way delay, each direction")
    ap.add_argument("--jitter", type=float, default=0.1, help="fraction of the delay, uniform (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    relay = DelayRelay(args.to, args.delay_ms, args.jitter, args.seed, host=host or "127.0.0.1")
    print(relay.start(int(port)), flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        relay.stop()
        print(relay.describe(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
