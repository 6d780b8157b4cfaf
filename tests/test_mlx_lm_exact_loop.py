"""generate_greedy's exact loop: a token that missed runs again layer by layer, once; while tokens need reads the
next runs layer by layer at once; the first that reads nothing goes back to the rule's graph. The tokens are
the unmodified model's throughout and each pass's routing is credited once."""

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from kq_host.residency import ResidencyManager  # noqa: E402
from kq_mlx.mlx_lm_adapter import SwitchGLUArena, attach_arena, generate_greedy  # noqa: E402
from test_mlx_lm import EXPERTS, LAYERS, _greedy_one_at_a_time, _manager_over, evaluated, qwen3_model  # noqa: E402

PROMPT = [2, 7, 1, 8]
TOP_K = 4  # qwen3_model's routing


def _recorded(manager, events):
    """``manager`` with its step, next_token and drain noting themselves in ``events`` ("step", "next", "drain")."""
    for name, event in (("step", "step"), ("next_token", "next"), ("drain", "drain")):
        method = getattr(manager, name)

        def recording(*args, _method=method, _event=event, **kwargs):
            events.append(_event)
            return _method(*args, **kwargs)
        setattr(manager, name, recording)
    return manager


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serial"])
def test_tokens_that_read_run_layer_by_layer_until_one_reads_nothing(overlap):
    """From a cold arena holding every expert: the first token misses and runs again layer by layer (its graph
    pass not stepped; ended by next_token); the tokens after run layer by layer at once while they read;
    once the routed experts are resident the loop is back on the graph (steps only). The tokens are the
    model's, each pass credited once."""
    steps = 16
    want = _greedy_one_at_a_time(qwen3_model, 7, PROMPT, steps)
    model = evaluated(qwen3_model, seed=7)
    blocks = attach_arena(model, num_slots=EXPERTS)
    events = []
    manager = _recorded(_manager_over(blocks, EXPERTS, queue_depth=0), events)
    assert generate_greedy(model, blocks, manager, PROMPT, steps, overlap=overlap, exact=True,
                           prefill_prompt=False) == want
    _, total = manager.stats()
    manager.close()
    passes = len(PROMPT) + steps - 1  # the last token generated is not fed
    assert total.lookups == passes * TOP_K * LAYERS  # every pass's routing credited once
    assert events[0] == "next" and "drain" not in events
    last_layered = max(i for i, event in enumerate(events) if event == "next")
    assert events[last_layered + 1:] == ["step"] * (len(events) - last_layered - 1) and "step" in events
    assert events.count("step") + events.count("next") == passes


def test_a_resident_arena_never_runs_layer_by_layer():
    """Every expert resident: each token is the graph's (one step a token), none runs again or layer by layer."""
    want = _greedy_one_at_a_time(qwen3_model, 7, PROMPT, 8)
    model = evaluated(qwen3_model, seed=7)
    blocks = attach_arena(model, num_slots=EXPERTS)
    events = []
    manager = _recorded(_manager_over(blocks, EXPERTS, queue_depth=0), events)
    for layer in range(LAYERS):
        manager.preload(layer, range(EXPERTS))
    assert generate_greedy(model, blocks, manager, PROMPT, 8, exact=True, prefill_prompt=False) == want
    manager.close()
    assert events == ["step"] * (len(PROMPT) + 8 - 1)


def _loud(seed):
    """qwen3_model with its experts' outputs 30 times larger: a layer's experts then move the next layer's
    routing (at the random weights' scale the residual stream hides them)."""
    model = evaluated(qwen3_model, seed=seed)
    for layer in model.model.layers:
        layer.mlp.switch_mlp.down_proj.weight = layer.mlp.switch_mlp.down_proj.weight * 30
    mx.eval(model.parameters())
    return model


def _credit_log(manager, credited):
    """``manager`` with the routing its step and acquire credit appended to ``credited[layer]`` (the ids, flat)."""
    step, acquire = manager.step, manager.acquire

    def stepping(report, *args, **kwargs):
        for layer in range(LAYERS):
            credited[layer] += report.indices[layer].ravel().tolist()
        return step(report, *args, **kwargs)

    def acquiring(layer, indices, scores, *args, credit=True, **kwargs):
        if credit:
            credited[layer] += np.asarray(indices).ravel().tolist()
        return acquire(layer, indices, scores, *args, credit=credit, **kwargs)

    manager.step, manager.acquire = stepping, acquiring
    return manager


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serial"])
def test_a_token_that_missed_credits_and_reads_only_the_routing_it_runs_with(overlap):
    """A pass that missed ran the layers after its first miss on a wrong input, so their routing is not the
    token's: the manager is credited each token's routing once, the routing of the pass that is kept (the
    unmodified model's), and reads no expert that only a discarded pass routed."""
    steps, slots = 12, 6
    model = _loud(seed=7)
    blocks = attach_arena(model, num_slots=EXPERTS)
    routed = [[] for _ in range(LAYERS)]  # every expert resident: each pass's routing is the model's
    manager = _credit_log(_manager_over(blocks, EXPERTS, queue_depth=0), routed)
    for layer in range(LAYERS):
        manager.preload(layer, range(EXPERTS))
    want = generate_greedy(model, blocks, manager, PROMPT, steps, exact=True, prefill_prompt=False)
    manager.close()

    model = _loud(seed=7)
    blocks = attach_arena(model, num_slots=slots)
    reads, credited = [], [[] for _ in range(LAYERS)]
    manager = _credit_log(ResidencyManager(
        LAYERS, EXPERTS, slots, arena=SwitchGLUArena(blocks), queue_depth=0,
        loader=lambda l, e, s: reads.append((l, e)) or blocks[l].expert_weights(e)), credited)
    assert generate_greedy(model, blocks, manager, PROMPT, steps, overlap=overlap, exact=True,
                           prefill_prompt=False) == want
    manager.close()
    assert manager.lookahead_stats()["critical_reads"].sum() > 0  # tokens missed and read
    for layer in range(LAYERS):
        assert sorted(credited[layer]) == sorted(routed[layer])
        assert {e for l, e in reads if l == layer} <= set(routed[layer])
