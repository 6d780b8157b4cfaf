"""The overlapped decode loop: token t+1 is dispatched before token t's boundary, on the tables one
boundary older, while that boundary writes landed experts into the arena. A JAX arena write makes new
arrays (the donated buffers are reused only once the computations reading them are done), so a token
reads the arena as it was when dispatched; every token's output must then be what its tables give on
an arena holding exactly the experts they map."""

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("safetensors")

from kq import demo_random as demo  # noqa: E402
from kq_host.expert_store import ExpertStore  # noqa: E402
from kq_host.residency import ResidencyManager  # noqa: E402


def test_overlapped_tokens_read_only_what_their_tables_map(tmp_path):
    cfg = demo.DemoConfig(layers=2, experts=16, top_k=4, hidden=32, ffn=16, steps=16, residency=0.25,
                          frameworks=("jax",))
    rng = np.random.default_rng(5)
    router, weights = demo.make_weights(cfg, rng)
    states = list(demo.hidden_states(cfg, rng))
    demo.write_checkpoint(tmp_path, weights)
    with ExpertStore(tmp_path, layout="per_expert", projections=demo.PROJECTIONS) as store:
        stack = demo.JaxStack(cfg, router, weights)
        manager = ResidencyManager(cfg.layers, cfg.experts, cfg.slots, arena=stack.arena, queue_depth=4,
                                   loader=lambda layer, expert, slot: store.read_expert(layer, expert))
        tables, used, outputs = manager.snapshot(), [], []
        pending = stack.dispatch(states[0], tables)
        used.append(tables)
        for index in range(len(states)):
            current = pending
            if index + 1 < len(states):
                pending = stack.dispatch(states[index + 1], tables)
                used.append(tables)
            y, reports = stack.readback(current)
            outputs.append(y)
            # Every read of the last boundary lands before this one, so the arena fills and evicts on
            # any machine; the token dispatched above still runs on the older tables.
            manager.drain()
            tables = manager.step(reports)
        manager.close()
        assert manager.stats()[1].reads_landed > 0 and manager.stats()[1].evictions > 0

        check = demo.JaxStack(cfg, router, weights)
        for index, (table, y) in enumerate(zip(used, outputs)):
            check.reset_arena(cfg.slots)
            layers, experts = np.nonzero(table >= 0)
            check.arena.write_slots(layers, table[layers, experts],
                                    [store.read_expert(int(l), int(e)) for l, e in zip(layers, experts)])
            want, _ = check.streamed_step(states[index], table)
            assert np.array_equal(want.view(np.uint32), y.view(np.uint32)), f"token {index}"
