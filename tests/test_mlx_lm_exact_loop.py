"""generate_greedy's exact loop: a token that missed runs again layer by layer, once; while tokens need reads the
next runs layer by layer at once; the first that reads nothing goes back to the rule's graph. The tokens are
the unmodified model's throughout and each pass's routing is credited once."""

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from kq_mlx.mlx_lm_adapter import attach_arena, generate_greedy  # noqa: E402
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
    """From a cold arena holding every expert: the first token misses and runs again (a drain); the tokens after
    run layer by layer at once while they read (ended by next_token); once the routed experts are resident the
    loop is back on the graph (steps only). The tokens are the model's, each pass credited once."""
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
    assert events[:2] == ["step", "drain"] and "next" in events
    last_layered = max(i for i, event in enumerate(events) if event == "next")
    assert "drain" not in events[last_layered:] and events[last_layered + 1:].count("step") >= 2
    assert events.count("drain") + events.count("next") < passes


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
