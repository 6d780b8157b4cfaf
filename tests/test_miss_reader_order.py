"""MissReader hands a program its projections in the order it takes them (gate, up, down): names that say
another order are refused by name, since gate and up have the same shape and a swap would run silently."""

import pytest

from kq_host.miss_reader import MissReader


class NoStore:
    def read_expert(self, layer, expert):
        raise AssertionError("not read")


@pytest.mark.parametrize("projections", [("up_proj", "gate_proj", "down_proj"), ("gate_proj", "down_proj", "up_proj"),
                                         ("w3", "w1", "w2"), ("gate_proj", "gate_proj", "down_proj"),
                                         ("mlp.up_proj.weight", "mlp.gate_proj.weight", "mlp.down_proj.weight")],
                         ids=lambda p: "-".join(p))
def test_projections_named_out_of_order_are_refused(projections):
    with pytest.raises(ValueError, match=r"MissReader: projections .*gate, up, down"):
        MissReader(NoStore(), projections)


@pytest.mark.parametrize("projections", [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"),
                                         ("a", "b", "c"), ("fc1", "fc2")], ids=lambda p: "-".join(p))
def test_projections_in_order_or_of_names_that_say_no_role_are_taken(projections):
    MissReader(NoStore(), projections).close()
