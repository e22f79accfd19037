"""Pipeline parallelism's schedules: in which order a stage runs the forward (F) and backward (B) of each
micro-batch, and what it sends and receives around each.

The model's blocks are cut into p stages, one per rank of the pipeline group; a step's batch into m
micro-batches. Stage s runs F(i) on the activations stage s - 1 sent it and sends its own to stage s + 1;
B(i) on the gradient stage s + 1 sent back, sending the gradient of its input to stage s - 1. Two orders:

    GPipe   all m forwards, then all m backwards. Stage s keeps the activations of all m micro-batches
            until their backwards.
    1F1B    (PipeDream-flush, as Megatron-LM runs it) a warm-up of min(p - s - 1, m) forwards, then
            alternate one forward and one backward, then the warm-up's backwards. Stage s holds at most
            min(p - s, m) micro-batches' activations: 1F1B trades nothing for that memory.

Both leave the same bubble: with every F costing the same and every B the same, a step takes (m + p - 1)
(F + B) where one stage's work is m (F + B), so each stage idles (p - 1) / (m + p - 1) of the step
(`bubble_fraction`; `simulate` times the schedules event by event, and the tests hold the two together).

The transfers are blocking pairs: a send completes once its receive is posted. Stage s sends its F(i)
output to s + 1 and, next, receives a gradient from s + 1 for a backward; s + 1 sends that gradient and
next receives s's output. Done one after the other both sides would wait on each other, so a send and the
receive that follows it from the same peer are one `sendrecv` (Megatron's send_forward_recv_backward and
send_backward_recv_forward): `transfers` lists them, and `run_schedule` runs them around the stage's work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..command import must_be, one_of
from ..config import GPTConfig
from ..errors import XtrainError
from ..layout import check_pp

SCHEDULES = ("gpipe", "1f1b")  # --pp-schedule


def check_config(cfg, config: GPTConfig) -> None:
    """--pp divides the world with --tp, gives every stage a block and has a schedule: one line if not (after
    parallel/tensor.py's checks of --tp)."""
    if isinstance(cfg.pp, bool) or not isinstance(cfg.pp, int) or cfg.pp < 1:
        raise XtrainError(must_be("--pp", "a positive integer", cfg.pp))
    if cfg.pp_schedule not in SCHEDULES:
        raise XtrainError(must_be("--pp-schedule", one_of(SCHEDULES), cfg.pp_schedule))
    groups = cfg.world_size // cfg.tp
    if groups % cfg.pp:
        over = f"the world size over --tp ({cfg.world_size} / {cfg.tp} = {groups})" if cfg.tp > 1 else \
            f"the world size ({cfg.world_size})"
        raise XtrainError(must_be("--pp", f"a divisor of {over}", cfg.pp))
    check_pp(config, cfg.pp)


def schedule(kind: str, stages: int, micro_batches: int, stage: int) -> list[tuple[str, int]]:
    """Stage `stage`'s actions in order: ("F", i) and ("B", i) for each micro-batch i."""
    if kind not in SCHEDULES:
        raise ValueError(f"a pipeline schedule is one of {', '.join(SCHEDULES)}, got {kind!r}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is outside a pipeline of {stages}")
    m = micro_batches
    if kind == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(stages - stage - 1, m)
    actions = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: the next forward, then the oldest backward
        actions += [("F", warmup + i), ("B", i)]
    actions += [("B", i) for i in range(m - warmup, m)]
    return actions


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The share of a step each stage idles when every F costs the same and every B the same."""
    return (stages - 1) / (micro_batches + stages - 1)


def peak_in_flight(actions: list[tuple[str, int]]) -> int:
    """The most micro-batches whose forward has run and backward has not, at once: what the stage keeps."""
    held = peak = 0
    for kind, _ in actions:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def schedule_peak_in_flight(kind: str, stages: int, micro_batches: int, stage: int) -> int:
    """peak_in_flight(schedule(kind, stages, micro_batches, stage)) without listing the schedule, so that the
    memory check before a run takes no longer for --grad-accum 1e9 than for 1: gpipe runs every forward
    before any backward (all m held); 1f1b holds its warmup's forwards and one more, stages - stage in all,
    and never more than m."""
    if kind not in SCHEDULES:
        raise ValueError(f"a pipeline schedule is one of {', '.join(SCHEDULES)}, got {kind!r}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is outside a pipeline of {stages}")
    return micro_batches if kind == "gpipe" else min(stages - stage, micro_batches)


def simulate(kind: str, stages: int, micro_batches: int, forward_cost: float = 1.0,
             backward_cost: float = 2.0) -> tuple[float, list[float]]:
    """(the step's duration, each stage's idle time) when each stage runs its actions in order, each as
    soon as the stage is free and its input has arrived (transfers take no time)."""
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, micro-batch) -> when it finished
    queues = [schedule(kind, stages, micro_batches, s) for s in range(stages)]
    position, free_at = [0] * stages, [0.0] * stages
    while any(position[s] < len(queues[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if position[s] == len(queues[s]):
                continue
            action, i = queues[s][position[s]]
            needs = ("F", s - 1, i) if action == "F" and s > 0 else ("B", s + 1, i) if action == "B" and \
                s < stages - 1 else None
            if needs is not None and needs not in done:
                continue
            start = max(free_at[s], done.get(needs, 0.0))
            free_at[s] = done[action, s, i] = start + (forward_cost if action == "F" else backward_cost)
            position[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"the {kind} schedule deadlocks")  # a stage waits on work that waits on it
    duration = max(free_at)
    busy = micro_batches * (forward_cost + backward_cost)
    return duration, [duration - busy for _ in range(stages)]


@dataclass(frozen=True)
class Transfer:
    """One blocking transfer of a stage: send `send` ("act" of micro-batch i, or "grad") to peer, receive
    `recv` from it, or both at once (a sendrecv)."""
    peer: int
    send: tuple[str, int] | None = None
    recv: tuple[str, int] | None = None


def transfers(actions: list[tuple[str, int]], stages: int, stage: int) -> list[tuple[str, object]]:
    """The stage's program: ("run", action) for its work and ("transfer", Transfer) for its communication,
    each send fused with the receive that follows it from the same peer."""
    program: list[tuple[str, object]] = []
    prev, nxt = stage - 1, stage + 1
    for action, i in actions:
        if action == "F" and stage > 0:
            _receive(program, prev, ("act", i))
        if action == "B" and stage < stages - 1:
            _receive(program, nxt, ("grad", i))
        program.append(("run", (action, i)))
        if action == "F" and stage < stages - 1:
            program.append(("transfer", Transfer(nxt, send=("act", i))))
        if action == "B" and stage > 0:
            program.append(("transfer", Transfer(prev, send=("grad", i))))
    return program


def _receive(program: list, peer: int, what: tuple[str, int]) -> None:
    last = program[-1] if program else None
    if last is not None and last[0] == "transfer" and last[1].peer == peer and last[1].recv is None:
        program[-1] = ("transfer", Transfer(peer, send=last[1].send, recv=what))  # a sendrecv
    else:
        program.append(("transfer", Transfer(peer, recv=what)))


def run_schedule(comm, kind: str, micro_batches: int, forward: Callable, backward: Callable,
                 activation_buffer: Callable, gradient_buffer: Callable) -> None:
    """Run this stage's part of one step over comm (the pipeline group: rank = stage).

    forward(i, inp) -> out: micro-batch i's forward on this stage (inp None on the first stage; out, the
    activations for the next stage, unused on the last); backward(i, dout) -> dinp (dout None on the last
    stage, which starts from its loss; dinp unused on the first). activation_buffer(i) and
    gradient_buffer(i) give the arrays a received activation and gradient land in."""
    stages, stage = comm.world_size, comm.rank
    outputs: dict[int, object] = {}   # F's output, sent to the next stage
    input_grads: dict[int, object] = {}  # B's gradient of its input, sent to the previous stage
    received: dict[tuple[str, int], object] = {}
    for step, item in transfers(schedule(kind, stages, micro_batches, stage), stages, stage):
        if step == "run":
            action, i = item
            if action == "F":
                outputs[i] = forward(i, received.pop(("act", i), None))
            else:
                input_grads[i] = backward(i, received.pop(("grad", i), None))
                outputs.pop(i, None)
            continue
        send = None
        if item.send is not None:
            what, i = item.send
            send = outputs[i] if what == "act" else input_grads.pop(i)
        recv = None
        if item.recv is not None:
            what, i = item.recv
            recv = received[item.recv] = activation_buffer(i) if what == "act" else gradient_buffer(i)
        if send is not None and recv is not None:
            comm.sendrecv(send, item.peer, recv, item.peer)
        elif send is not None:
            comm.send(send, item.peer)
        else:
            comm.recv(recv, item.peer)
