#!/usr/bin/env python3
"""A slow, lossy link in user space, for kernels without ``tc netem`` (this machine's has none).

Usage (in the test cluster's switch namespace, started by ``tools/testcluster.py``)::

    python3 tools/delayline.py IFACE_A IFACE_B DELAY_MS LOSS_PERCENT

Every Ethernet frame that arrives on one interface leaves on the other
``DELAY_MS`` later, unless it is dropped (each frame independently, with
probability ``LOSS_PERCENT`` / 100): netem's ``delay D loss L`` in both
directions. ``PACKET_VNET_HDR`` keeps each frame's offload header (a TCP
segment of 64 KiB that the sender left for the NIC to cut, a checksum left
to compute), so the kernel finishes the frame on the way out as it would
have without this program in between. Runs until killed.
"""

from __future__ import annotations

import heapq
import random
import select
import socket
import sys
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23  # our own sends on an interface are not frames to forward back
MAX_FRAME = 70_000           # a 64 KiB GSO frame and its headers


def open_interface(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    sock.bind((name, 0))
    sock.setblocking(False)
    return sock


def forward(a: socket.socket, b: socket.socket, delay_s: float, loss: float) -> None:
    """Forwards frames between ``a`` and ``b`` forever, each ``delay_s`` late or (probability ``loss``) never."""
    other = {a: b, b: a}
    due: list = []  # (departure time, sequence number, socket, frame)
    sequence = 0
    while True:
        wait = max(0.0, due[0][0] - time.monotonic()) if due else None
        readable, _, _ = select.select([a, b], [], [], wait)
        for sock in readable:
            while True:
                try:
                    frame = sock.recv(MAX_FRAME)
                except BlockingIOError:
                    break
                if random.random() >= loss:
                    sequence += 1
                    heapq.heappush(due, (time.monotonic() + delay_s, sequence, other[sock], frame))
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, out, frame = heapq.heappop(due)
            try:
                out.send(frame)
            except OSError as exc:  # a full queue drops the frame, as a link would
                print(f"delayline: dropped a frame of {len(frame)} bytes: {exc}", file=sys.stderr, flush=True)


def main(argv: list) -> int:
    if len(argv) != 4:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        delay_ms, loss_percent = float(argv[2]), float(argv[3])
    except ValueError:
        print(f"delayline: DELAY_MS ({argv[2]!r}) and LOSS_PERCENT ({argv[3]!r}) must be numbers", file=sys.stderr)
        return 2
    if delay_ms < 0 or not 0 <= loss_percent < 100:
        print(f"delayline: DELAY_MS ({delay_ms}) must be >= 0 and LOSS_PERCENT ({loss_percent}) in [0, 100)",
              file=sys.stderr)
        return 2
    a, b = open_interface(argv[0]), open_interface(argv[1])
    print("ready", flush=True)  # the caller waits for this line: from now on no frame is lost unannounced
    forward(a, b, delay_ms / 1000.0, loss_percent / 100.0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
