"""How much of a node the end of a run leaves idle, and what order-blind chunked scheduling would win back.

A zero-cost model (no overhead, no prefill time) of ``slots`` decoding at ``tok_per_s`` each, on the
output lengths ``bench_node.py``'s simulated servers draw for its prompts (lognormal, median 1,970,
sigma 0.8, cut at the cap). Prints the efficiency (tokens / (capacity x makespan)) of:

- first-come (what the pipeline does, and any scheduler that cannot know lengths in advance);
- longest-first with the lengths known in advance (clairvoyant; not possible, an upper mark);
- first-come, then the last ``window`` prompts generated in chunks of ``chunk`` tokens, a cut sequence
  continued later behind every fresh prompt. Beside each: the prefix tokens those continuations send
  again, per generated token (prefill the GPU must redo unless the prefix cache still holds them);
- the same with the pipeline's own queues (``inference.client.tail_chunk_tokens``; the client's
  ``FollowUpLanes``, called here): one FIFO per server, a continuation queued on the server that wrote
  its prefix; a slot takes its own server's oldest, unless that queue is shorter than the longest by
  more than slots per server // 8: then the longest queue's continuation with the fewest tokens so far,
  whose prefix is then prefilled again on the new server (``--prefill-tok-per-s``; only that slot waits
  here, the whole server in ``bench_node``'s stand-in).

    python bench/bench_drain.py [--prompts 2000] [--slots 280] [--cap 4096]
"""

from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from headline import headline

from dflash_assets.generation.client.follow_ups import FollowUpLanes
from dflash_simulators.simulated_replies import drawn_length


def makespan(lengths: list[int], slots: int, tok_per_s: float, window: int = 0, chunk: int = 0) -> tuple[float, int]:
    """Seconds until the last token, and prefix tokens re-sent, for first-come order with the last
    ``window`` prompts chunked at ``chunk`` tokens (continuations queue behind fresh prompts)."""
    n = len(lengths)
    fresh, continuations = list(range(n)), []
    next_fresh = next_continuation = 0
    finishing: list[tuple[float, int, int]] = []  # (time, prompt, tokens done after this request)
    busy, resent, end = 0, 0, 0.0

    def start(now: float) -> None:
        nonlocal busy, resent, next_fresh, next_continuation
        while busy < slots:
            if next_fresh < n:
                i, done = fresh[next_fresh], 0
                next_fresh += 1
            elif next_continuation < len(continuations):
                i, done = continuations[next_continuation]
                next_continuation += 1
            else:
                return
            left = lengths[i] - done
            step = min(chunk, left) if i >= n - window else left
            resent += done
            heapq.heappush(finishing, (now + step / tok_per_s, i, done + step))
            busy += 1

    start(0.0)
    while finishing:
        end, i, done = heapq.heappop(finishing)
        busy -= 1
        if done < lengths[i]:
            continuations.append((i, done))
        start(end)
    return end, resent


def lanes_makespan(
    lengths: list[int], servers: int, slots: int, tok_per_s: float, window: int, chunk: int, prefill_tok_per_s: float
) -> tuple[float, int]:
    """Seconds until the last token, and prefix tokens prefilled again (moved to another server), with
    the continuations queued in the pipeline's own
    :class:`~dflash_assets.generation.client.follow_ups.FollowUpLanes`."""
    n = len(lengths)
    lanes = FollowUpLanes(steal_margin=max(1, slots // 8))  # the client's margin: slots per server // 8
    finishing: list[tuple[float, int, int, int]] = []  # (time, prompt, tokens done after it, server)
    idle = [0] * servers
    next_fresh, moved = 0, 0

    def start(now: float, server: int) -> bool:
        nonlocal next_fresh, moved
        cost = 0.0
        if next_fresh < n:
            i, done = next_fresh, 0
            next_fresh += 1
        else:
            taken = lanes.take(str(server))
            if taken is None:
                return False
            _, (i, done, origin), _ = taken
            if origin != server:  # its prefix is not in this server's cache
                moved += done
                cost = done / prefill_tok_per_s
        left = lengths[i] - done
        step = min(chunk, left) if done or i >= n - window else left
        heapq.heappush(finishing, (now + cost + step / tok_per_s, i, done + step, server))
        return True

    for server in range(servers):
        for _ in range(slots):
            start(0.0, server)
    end = 0.0
    while finishing:
        end, i, done, server = heapq.heappop(finishing)
        if done < lengths[i]:
            lanes.push(str(server), done, i, (i, done, server))
        idle[server] += 0 if start(end, server) else 1
        for k in range(servers):  # slots that found nothing take what this one queued
            while idle[k] and start(end, k):
                idle[k] -= 1
    return end, moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--slots", type=int, default=280, help="servers x max_running_requests")
    parser.add_argument("--tok-per-s", type=float, default=87.5, help="decode rate of one slot")
    parser.add_argument("--cap", type=int, default=4096)
    parser.add_argument("--servers", type=int, default=7, help="for the per-server queues (slots split evenly)")
    parser.add_argument("--prefill-tok-per-s", type=float, default=9000.0, help="prefill of a moved prefix, per server")
    args = parser.parse_args()
    lengths = [
        min(drawn_length([{"role": "user", "content": f"bench prompt {i}"}], 1970, 0.8), args.cap)
        for i in range(args.prompts)
    ]
    total = sum(lengths)

    def efficiency(seconds: float) -> float:
        return total / (args.slots * args.tok_per_s * seconds)

    first_come, _ = makespan(lengths, args.slots, args.tok_per_s)
    longest_first, _ = makespan(sorted(lengths, reverse=True), args.slots, args.tok_per_s)
    print(f"prompts: {args.prompts}  slots: {args.slots}  cap: {args.cap}  tokens: {total}")
    print(
        f"first_come_efficiency: {efficiency(first_come):.3f} (no goal; the bound of any order-blind scheduler "
        f"without chunking; drain {first_come - total / (args.slots * args.tok_per_s):.1f} s)"
    )
    headline(
        f"zero-cost model, {args.prompts} prompts on {args.slots} slots: first-come efficiency (the bound of "
        f"any order-blind scheduler without chunks)",
        efficiency(first_come),
        "none (context: it sizes bench_node's 0.90 goal)",
    )
    print(f"longest_first_known_lengths_efficiency: {efficiency(longest_first):.3f} (clairvoyant, not possible)")
    for window in (args.slots, 2 * args.slots, args.prompts // 2, args.prompts):
        for chunk in (512, 1024, 2048):
            seconds, resent = makespan(lengths, args.slots, args.tok_per_s, window, chunk)
            print(
                f"chunked last {window} prompts at {chunk} tokens: efficiency {efficiency(seconds):.3f}, "
                f"prefix tokens re-sent per generated token {resent / total:.2f}"
            )
    per_server = args.slots // args.servers
    for per_slot in (2, 4, 6):
        for chunk in (256, 512, 1024):
            window = min(args.prompts, per_slot * args.slots)
            seconds, moved = lanes_makespan(
                lengths, args.servers, per_server, args.tok_per_s, window, chunk, args.prefill_tok_per_s
            )
            print(
                f"pipeline queues (per server, balanced), last {window} prompts ({per_slot} per slot) at {chunk} "
                f"tokens: efficiency {efficiency(seconds):.3f}, prefix tokens prefilled again on another server "
                f"{moved} ({moved / total:.3f} per generated token)"
            )
            if (per_slot, chunk) == (4, 512):  # the pipeline's defaults once tail_chunk_tokens is set to 512
                headline(
                    f"zero-cost model: efficiency with the pipeline's per-server queues, last {window} prompts "
                    f"in {chunk}-token chunks",
                    efficiency(seconds),
                    "none (context: the best bench_node can do)",
                )


if __name__ == "__main__":
    main()
