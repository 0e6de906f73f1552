import pytest

from eagle3data.hidden_states.layers import AuxLayers, default_aux_layer_ids, resolve_aux_layers


@pytest.mark.parametrize(
    ("num_layers", "layer_output", "hidden_states_index"),
    [
        (30, (1, 14, 26), (2, 15, 27)),  # SmolLM2
        (32, (1, 15, 28), (2, 16, 29)),  # Llama-3-8B
        (36, (1, 17, 32), (2, 18, 33)),  # Qwen3-8B
        (61, (1, 29, 57), (2, 30, 58)),  # Kimi-K2.5 / DeepSeek-V3
        (80, (1, 39, 76), (2, 40, 77)),  # Llama-3-70B
    ],
)
def test_default_rule(num_layers, layer_output, hidden_states_index):
    assert default_aux_layer_ids(num_layers) == layer_output
    aux = resolve_aux_layers("auto", num_layers)
    assert aux.layer_ids == layer_output
    assert aux.hidden_states_indices == hidden_states_index
    assert aux.num_layers == num_layers


def test_explicit_ids_in_both_conventions_name_the_same_layers():
    a = resolve_aux_layers([1, 29, 57], 61, "layer_output")
    b = resolve_aux_layers([2, 30, 58], 61, convention="hidden_states_index")
    assert a == b
    assert a.layer_ids == (1, 29, 57)
    assert b.hidden_states_indices == (2, 30, 58)


def test_explicit_ids_may_use_the_edges_of_the_range():
    assert resolve_aux_layers([0, 5, 9], 10).layer_ids == (0, 5, 9)
    assert resolve_aux_layers([1, 5, 10], 10, "hidden_states_index").layer_ids == (0, 4, 9)


def test_explicit_ids_accept_any_integer_sequence():
    import numpy as np

    assert resolve_aux_layers(np.array([1, 15, 28]), 32).layer_ids == (1, 15, 28)
    assert resolve_aux_layers((1, 15, 28), 32).layer_ids == (1, 15, 28)


def test_as_attrs_spells_out_both_conventions():
    attrs = resolve_aux_layers("auto", 61).as_attrs()
    assert attrs == {
        "aux_layer_ids": [1, 29, 57],
        "aux_layer_convention": "layer_output: output of 0-based decoder layer k",
        "aux_hidden_states_indices": [2, 30, 58],
        "aux_hidden_states_convention": (
            "hidden_states_index: transformers output_hidden_states[k], 0 = embeddings"
        ),
        "num_layers": 61,
    }


@pytest.mark.parametrize(
    ("spec", "convention", "match"),
    [
        ([1, 2], "layer_output", "exactly 3"),
        ([1, 2, 3, 4], "layer_output", "exactly 3"),
        ([1, 15, 32], "layer_output", r"aux layer id 32 .*valid range is 0\.\.31"),
        ([-1, 15, 28], "layer_output", r"aux layer id -1 .*valid range is 0\.\.31"),
        ([2, 16, 33], "hidden_states_index", r"aux layer id 33 .*valid range is 1\.\.32"),
        ([0, 16, 29], "hidden_states_index", r"index 0 is the embedding.*1\.\.32"),
        ([1, 28, 15], "layer_output", "strictly increasing"),
        ([1, 15, 15], "layer_output", "strictly increasing"),
        ([1, True, 28], "layer_output", "not an integer"),
        ([1, 15.0, 28], "layer_output", "not an integer"),
        ("last", "layer_output", "'auto'"),
    ],
)
def test_bad_explicit_ids(spec, convention, match):
    with pytest.raises(ValueError, match=match):
        resolve_aux_layers(spec, 32, convention)


def test_unknown_convention():
    with pytest.raises(ValueError, match="unknown aux layer convention"):
        resolve_aux_layers([1, 2, 3], 32, "hf")  # type: ignore[arg-type]


@pytest.mark.parametrize("num_layers", [1, 4, 5, 6])
def test_default_rule_refuses_too_few_layers(num_layers):
    with pytest.raises(ValueError, match="at least 7 decoder layers"):
        default_aux_layer_ids(num_layers)
    with pytest.raises(ValueError, match="at least 7 decoder layers"):
        resolve_aux_layers("auto", num_layers)


def test_smallest_model_the_default_rule_allows():
    assert default_aux_layer_ids(7) == (1, 2, 3)


@pytest.mark.parametrize("num_layers", [0, -3, True, 2.5, "32"])
def test_num_layers_must_be_a_positive_integer(num_layers):
    with pytest.raises(ValueError, match="num_layers must be a positive integer"):
        default_aux_layer_ids(num_layers)


def test_aux_layers_cannot_be_built_invalid():
    with pytest.raises(ValueError, match=r"valid range is 0\.\.31"):
        AuxLayers((1, 15, 32), 32)
