"""`kq check --impl MODULE:FUNCTION` and `kq.spec`: the spec run against another project's route_shed."""

import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kq.cli import main
from kq_core.spec import load_spec

GOLDEN = len(load_spec().cases)
OPTION_CASES = sum(1 for case in load_spec().cases if case.options)
TIER_CASES = sum(1 for case in load_spec().cases if case.options.get("on_miss") == "tier")

# Implementations another project could ship, each a module of its own. `oracle` is kq's NumPy oracle under
# another name: a correct implementation.
IMPLEMENTATIONS = {
    "correct_impl": """
        from kq_core.oracle import route_shed_oracle

        def route_shed(indices, scores, slot_table, num_slots=None, on_miss="shed"):
            return route_shed_oracle(indices, scores, slot_table, num_slots=num_slots, on_miss=on_miss)
    """,
    "one_ulp_impl": """
        import numpy as np
        from kq_core.oracle import route_shed_oracle

        def route_shed(indices, scores, slot_table, **options):
            out = route_shed_oracle(indices, scores, slot_table, **options)
            if indices.shape == (9, 4):  # the golden case special_scores only: one ulp up in one entry
                mix = out.mix.copy()
                mix.view(np.uint32)[0, 1] += 1
                out = out._replace(mix=mix)
            return out
    """,
    "raising_impl": """
        from kq_core.oracle import route_shed_oracle

        def route_shed(indices, scores, slot_table, num_slots=None, on_miss="shed"):
            if indices.shape[0] == 0:
                raise ValueError("zero rows are not supported")
            return route_shed_oracle(indices, scores, slot_table, num_slots=num_slots, on_miss=on_miss)
    """,
    "wrong_outputs_impl": """
        import numpy as np
        from kq_core.oracle import route_shed_oracle

        def int64_slots(indices, scores, slot_table):
            out = route_shed_oracle(indices, scores, slot_table)
            return out._replace(slots=out.slots.astype(np.int64))

        def three_outputs(indices, scores, slot_table):
            return tuple(route_shed_oracle(indices, scores, slot_table))[:3]

        def a_dict(indices, scores, slot_table):
            return route_shed_oracle(indices, scores, slot_table)._asdict()

        NOT_A_FUNCTION = 3
    """,
    "writing_impl": """
        from kq_core.oracle import route_shed_oracle

        def route_shed(indices, scores, slot_table):
            out = route_shed_oracle(indices, scores, slot_table)
            scores[...] = 0  # scribbles on its inputs after use
            slot_table[...] = -1
            return out
    """,
    "shed_only_impl": """
        from kq_core.oracle import route_shed_oracle

        def route_shed(indices, scores, slot_table, num_slots=None):
            return route_shed_oracle(indices, scores, slot_table, num_slots=num_slots)
    """,
    "broken_import_impl": """
        raise RuntimeError("this module needs a Metal GPU")
    """,
    "exiting_import_impl": """
        import sys

        sys.exit(3)
    """,
    "exiting_impl": """
        import sys

        def route_shed(indices, scores, slot_table):
            sys.exit(3)  # a library's own "give up": that case's failure, not the check's end
    """,
    "jax_impl": """
        import jax
        import numpy as np
        from kq_core.oracle import route_shed_oracle

        def route_shed(indices, scores, slot_table, num_slots=None, on_miss="shed"):
            # JAX arrays in (their bits the NumPy inputs'), JAX arrays out (kq_jax's own kernels compile per shape)
            assert all(isinstance(array, jax.Array) for array in (indices, scores, slot_table))
            out = route_shed_oracle(*map(np.asarray, (indices, scores, slot_table)), num_slots=num_slots,
                                    on_miss=on_miss)
            return tuple(jax.numpy.asarray(array) for array in out)
    """,
    "mlx_impl": """
        import kq_mlx

        route_shed = kq_mlx.route_shed
    """,
}


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A directory of the modules above, importable (as the current directory is to `kq check`)."""
    for name, source in IMPLEMENTATIONS.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _table_row(out: str, label: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(label))


def test_a_correct_implementation_passes_every_case(project, capsys):
    assert main(["check", "--impl", "correct_impl:route_shed", "--random-rows", "24"]) == 0
    out = capsys.readouterr().out
    random_cases = len(list(__import__("kq.check", fromlist=["random_cases"]).random_cases(0, 24)))
    run = GOLDEN + random_cases
    assert re.search(rf"correct_impl:route_shed\s+numpy arrays\s+{run}/{run}\s+24\s+-", out), out
    assert "1 implementation ran, 0 with mismatches" in out


def test_impl_runs_beside_the_backends_named(project, capsys):
    assert main(["check", "--backends", "numpy-oracle", "--impl", "correct_impl:route_shed", "--impl",
                 "shed_only_impl:route_shed", "--random-rows", "8"]) == 0
    out = capsys.readouterr().out
    assert "numpy-oracle" in out and "correct_impl:route_shed" in out and "shed_only_impl:route_shed" in out
    assert "3 implementations ran, 0 with mismatches" in out


def test_a_one_ulp_error_in_one_case_is_caught_and_printed_in_full(project, capsys):
    assert main(["check", "--impl", "one_ulp_impl:route_shed", "--random-rows", "8"]) == 1
    out = capsys.readouterr().out
    run = GOLDEN + len(list(__import__("kq.check", fromlist=["random_cases"]).random_cases(0, 8)))
    row = _table_row(out, "one_ulp_impl:route_shed")
    assert f"{run - 1}/{run}" in row and "special_scores: mix[0, 1]" in row
    snippet = out[out.index("```python\n") + len("```python\n"):out.rindex("```")]
    assert "indices = np.array(" in snippet and "expected = RouteShedResult(" in snippet and "got = " in snippet
    # The case as printed is a test: run it, and it fails the same way; the expected outputs are the spec's.
    namespace = {}
    with pytest.raises(AssertionError, match=r"special_scores: mix\[0, 1\]"):
        exec(compile(snippet, "pasted", "exec"), namespace)
    case = load_spec().case("special_scores")
    for name, want in zip(case.expected._fields, case.expected):
        assert namespace["expected"]._asdict()[name].view(np.uint32).tolist() == want.view(np.uint32).tolist()
    got_mix = namespace["got"].mix.view(np.uint32)
    assert got_mix[0, 1] == case.expected.mix.view(np.uint32)[0, 1] + 1


def test_a_large_case_is_printed_as_its_first_differing_row(project, capsys, tmp_path):
    (tmp_path / "row_impl.py").write_text(textwrap.dedent("""
        from kq_core.oracle import route_shed_oracle

        def route_shed(indices, scores, slot_table):
            out = route_shed_oracle(indices, scores, slot_table)
            if indices.shape[0] == 4096:  # random_block: one entry of row 1000 wrong
                out.miss_ids[1000, 0] = 7
            return out
    """))
    assert main(["check", "--impl", "row_impl:route_shed", "--random-rows", "0"]) == 1
    out = capsys.readouterr().out
    assert "random_block: miss_ids[1000, 0]" in out
    assert "row 1000 of random_block (4096 rows)" in out and "alone, this row gives the expected outputs" in out
    assert "golden_cases()" in out  # how to get the whole case back


def test_a_large_case_without_one_differing_entry_is_fetched_by_name(project, capsys, tmp_path):
    (tmp_path / "large_raise_impl.py").write_text(textwrap.dedent("""
        from kq_core.oracle import route_shed_oracle

        def route_shed(indices, scores, slot_table):
            if indices.shape[0] == 4096:
                raise MemoryError("4096 rows do not fit")
            return route_shed_oracle(indices, scores, slot_table)
    """))
    assert main(["check", "--impl", "large_raise_impl:route_shed", "--random-rows", "0"]) == 1
    out = capsys.readouterr().out
    snippet = out[out.index("```python\n") + len("```python\n"):out.rindex("```")]
    assert "# 4096 rows, too many to print" in snippet and "indices = " not in snippet
    with pytest.raises(AssertionError, match="random_block: raised MemoryError: 4096 rows do not fit"):
        exec(compile(snippet, "pasted", "exec"), {})


def test_a_raising_function_fails_that_case_and_the_run_goes_on(project, capsys):
    assert main(["check", "--impl", "raising_impl:route_shed", "--random-rows", "8"]) == 1
    out = capsys.readouterr().out
    run = GOLDEN + len(list(__import__("kq.check", fromlist=["random_cases"]).random_cases(0, 8)))
    row = _table_row(out, "raising_impl:route_shed")
    # zero_rows and tier_zero_rows raise; every other case ran and passed.
    assert f"{run - 2}/{run}" in row and "zero_rows: raised ValueError: zero rows are not supported" in row
    assert "# got: raised ValueError: zero rows are not supported" in out


def test_a_function_that_exits_fails_each_case_and_the_run_goes_on(project, capsys):
    assert main(["check", "--impl", "exiting_impl:route_shed", "--random-rows", "0"]) == 1
    assert "raised SystemExit: 3" in _table_row(capsys.readouterr().out, "exiting_impl:route_shed")


@pytest.mark.parametrize("function, message", [
    ("int64_slots", "slots: expected int32[1, 8], got int64[1, 8]"),
    ("three_outputs", "returned 3 outputs; the contract has 4: slots, mix, miss_ids, miss_scores"),
    ("a_dict", "returned a dict; the contract's outputs are a sequence of 4 arrays"),
])
def test_outputs_of_the_wrong_dtype_or_count_are_named(project, capsys, function, message):
    assert main(["check", "--impl", f"wrong_outputs_impl:{function}", "--random-rows", "0"]) == 1
    assert message in _table_row(capsys.readouterr().out, f"wrong_outputs_impl:{function}")


@pytest.mark.parametrize("target, message", [
    ("no_such_module_anywhere:route_shed", "module 'no_such_module_anywhere' does not import "
                                           "(ModuleNotFoundError: No module named 'no_such_module_anywhere')"),
    ("broken_import_impl:route_shed", "module 'broken_import_impl' does not import "
                                      "(RuntimeError: this module needs a Metal GPU)"),
    ("exiting_import_impl:route_shed", "module 'exiting_import_impl' does not import (SystemExit: 3)"),
    ("correct_impl:route_shd", "correct_impl has no attribute 'route_shd'"),
    ("wrong_outputs_impl:NOT_A_FUNCTION", "NOT_A_FUNCTION is an int, not a callable"),
    ("correct_impl.route_shed", "not MODULE:FUNCTION"),
])
def test_an_impl_that_cannot_be_loaded_is_refused_naming_it(project, capsys, target, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["check", "--impl", target])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--impl" in err and message in err, err


def test_a_function_writing_into_its_inputs_leaves_the_cases_as_they_were(project, capsys):
    from kq.spec import golden_cases

    before = golden_cases()
    assert main(["check", "--impl", "writing_impl:route_shed", "--random-rows", "0"]) == 1
    assert main(["check", "--impl", "correct_impl:route_shed", "--random-rows", "0"]) == 0
    for old, new in zip(before, golden_cases()):
        for was, now in zip((*old.inputs, *old.expected), (*new.inputs, *new.expected)):
            assert was.tobytes() == now.tobytes()


def test_cases_needing_an_option_the_function_lacks_are_skipped_and_counted(project, capsys):
    assert main(["check", "--impl", "shed_only_impl:route_shed", "--impl", "wrong_outputs_impl:int64_slots",
                 "--random-rows", "0"]) == 1
    out = capsys.readouterr().out
    assert f"{GOLDEN - TIER_CASES}/{GOLDEN - TIER_CASES} ({TIER_CASES} skipped" in _table_row(
        out, "shed_only_impl:route_shed")
    assert f"({OPTION_CASES} skipped" in _table_row(out, "wrong_outputs_impl:int64_slots")
    assert re.search(rf"{TIER_CASES} cases skipped, each needing an option the function does not take; the first, "
                     r"tier_decode: shed_only_impl:route_shed takes no on_miss \(the case needs on_miss='tier'\)", out)


@pytest.mark.parametrize("arrays, module", [("jax", "jax"), ("mlx", "mlx")])
def test_impl_arrays_hand_the_function_framework_arrays(project, capsys, arrays, module):
    pytest.importorskip(module)
    assert main(["check", "--impl", f"{arrays}_impl:route_shed", "--impl-arrays", arrays, "--random-rows", "6"]) == 0
    out = capsys.readouterr().out
    assert f"{arrays} arrays" in _table_row(out, f"{arrays}_impl:route_shed") and "0 with mismatches" in out


def test_spec_cases_carry_the_oracles_outputs():
    from kq.spec import golden_cases, random_cases
    from kq_core.oracle import route_shed_oracle

    golden = golden_cases()
    assert len(golden) == GOLDEN and str(golden[0]) == golden[0].name == "decode_typical"
    randoms = random_cases(seed=3, rows=40)
    assert sum(case.indices.shape[0] for case in randoms) == 40
    assert [c.name for c in random_cases(seed=3, rows=40)] == [c.name for c in randoms]
    for case in [*golden[:3], *randoms]:
        want = route_shed_oracle(case.indices, case.scores, case.slot_table, **case.options)
        for expected, oracle in zip(case.expected, want):
            assert expected.tobytes() == oracle.tobytes() and expected.dtype == oracle.dtype


def test_assert_matches_names_the_first_differing_case():
    from kq.spec import assert_matches, golden_cases
    from kq_core.oracle import route_shed_oracle

    def off_in_tier_cases(indices, scores, slot_table, num_slots=None, on_miss="shed"):
        out = route_shed_oracle(indices, scores, slot_table, num_slots=num_slots, on_miss=on_miss)
        return out._replace(slots=out.slots + 1) if on_miss == "tier" else out

    assert assert_matches(off_in_tier_cases, golden_cases()[0]) == (1, ())
    differing = sum(1 for case in load_spec().cases if case.options.get("on_miss") == "tier" and case.rows)
    with pytest.raises(AssertionError, match=rf"{differing} of {GOLDEN} cases differ; the first, tier_decode: slots"):
        assert_matches(off_in_tier_cases, golden_cases())


def test_assert_matches_skips_a_case_needing_an_option_the_function_lacks():
    from kq.spec import assert_matches, golden_cases
    from kq_core.oracle import route_shed_oracle

    tier_case = next(case for case in golden_cases() if case.options.get("on_miss") == "tier")
    with pytest.raises(pytest.skip.Exception, match="takes no on_miss"):
        assert_matches(lambda indices, scores, slot_table, num_slots=None: route_shed_oracle(
            indices, scores, slot_table, num_slots=num_slots), tier_case)


def test_assert_matches_refuses_what_is_not_a_case_or_a_function():
    from kq.spec import assert_matches, golden_cases

    with pytest.raises(TypeError, match="fn must be callable"):
        assert_matches("route_shed", golden_cases()[0])
    with pytest.raises(TypeError, match="cases must be a Case or an iterable of Case"):
        assert_matches(lambda *args: args, [1, 2])
    with pytest.raises(ValueError, match="arrays must be one of"):
        assert_matches(lambda *args: args, golden_cases()[0], arrays="torch")


def test_the_pytest_helper_parametrizes_another_projects_tests(tmp_path):
    (tmp_path / "toy_route_shed.py").write_text(textwrap.dedent("""
        from kq_core.oracle import route_shed_oracle

        def route_shed(indices, scores, slot_table, num_slots=None):
            return route_shed_oracle(indices, scores, slot_table, num_slots=num_slots)
    """))
    (tmp_path / "test_toy.py").write_text(textwrap.dedent("""
        import pytest
        from kq.spec import assert_matches, golden_cases, random_cases
        from toy_route_shed import route_shed

        @pytest.mark.parametrize("case", golden_cases() + random_cases(seed=1, rows=30), ids=str)
        def test_route_shed_matches_the_spec(case):
            assert_matches(route_shed, case)
    """))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                             "-rs", "test_toy.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    from kq.spec import random_cases

    randoms = len(random_cases(seed=1, rows=30))
    summary = result.stdout.strip().splitlines()[-1]
    assert f"{GOLDEN - TIER_CASES + randoms} passed, {TIER_CASES} skipped" in summary, result.stdout + result.stderr
    assert "takes no on_miss" in result.stdout  # the skips' reason, in pytest's summary (-rs)


def test_impl_arrays_without_impl_is_refused_naming_both(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["check", "--impl-arrays", "jax"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--impl-arrays applies to the functions of --impl" in err


def test_a_large_random_case_is_fetched_from_the_seed_and_rows_it_came_from():
    import kq.spec
    from kq.spec import assert_matches, random_cases
    from kq_core.oracle import route_shed_oracle

    def raising_on_batches(indices, scores, slot_table):
        if indices.shape[0] > 16:
            raise MemoryError("batches of more than 16 rows do not fit")
        return route_shed_oracle(indices, scores, slot_table)

    cases = random_cases(seed=7, rows=512)
    with pytest.raises(AssertionError) as error:
        assert_matches(raising_on_batches, cases)
    fetch = re.search(r"^case = (.*)$", str(error.value), re.M).group(1)
    assert "random_cases(7, 512)" in fetch
    fetched = eval(fetch, {"kq": kq})
    first_large = next(case for case in cases if case.indices.shape[0] > 16)
    assert fetched.name == first_large.name
    for ours, theirs in zip((*first_large.inputs, *first_large.expected), (*fetched.inputs, *fetched.expected)):
        assert ours.dtype == theirs.dtype and ours.tobytes() == theirs.tobytes()


def test_a_large_case_of_the_callers_own_is_not_fetched_from_kq_spec():
    from kq.spec import Case, assert_matches, random_cases

    drawn = next(case for case in random_cases(seed=7, rows=512) if case.indices.shape[0] > 16)
    own = Case("my_batch", *drawn.inputs)

    def raising(indices, scores, slot_table):
        raise MemoryError("too large")

    with pytest.raises(AssertionError, match="my_batch: raised MemoryError") as error:
        assert_matches(raising, own)
    assert "kq.spec.random_cases" not in str(error.value) and "kq.spec.golden_cases" not in str(error.value)


def test_assert_matches_refuses_no_cases_by_name():
    from kq.spec import assert_matches
    from kq_core.oracle import route_shed_oracle

    for nothing in ([], (), iter([])):
        with pytest.raises(ValueError, match="cases"):
            assert_matches(route_shed_oracle, nothing)


@pytest.mark.parametrize("argument, value", [("seed", -1), ("seed", 1.5), ("seed", "7"), ("seed", True),
                                             ("seed", None), ("rows", -1), ("rows", 1.5), ("rows", "8"),
                                             ("rows", True)])
def test_random_cases_refuses_a_bad_seed_or_rows_by_name(argument, value):
    from kq.spec import random_cases

    message = rf"random_cases: {argument} must be an int >= 0, got {re.escape(repr(value))}"
    with pytest.raises(ValueError, match=message):
        random_cases(**{argument: value})


def test_the_random_case_mix_is_one_generator_of_the_contract_layer():
    import kq.check
    from kq.spec import random_cases
    from kq_core import inputs

    assert kq.check.random_cases is inputs.random_cases
    drawn = list(inputs.random_cases(5, 40))
    cases = random_cases(seed=5, rows=40)
    assert [name for name, _ in drawn] == [case.name for case in cases]
    for (_, arrays), case in zip(drawn, cases):
        for ours, theirs in zip(arrays, case.inputs):
            assert ours.dtype == theirs.dtype and ours.tobytes() == theirs.tobytes()
    assert any(case.scores.view(np.uint16 if case.scores.itemsize == 2 else np.uint32).any() for case in cases)
