"""The rules of helpers.layout_rules name what they refuse: the pipeline's chunks by pp and vpp."""

import pytest

from helpers import layout_rules


def test_too_many_chunks_names_pp_and_vpp_and_the_largest_vpp_that_fits():
    expected = (r"^n_chunks=12 \(pp·vpp\) must not exceed n_layers=8 of m: every chunk needs a layer "
                r"\(pp=4 stages of vpp=3 chunks each; with pp=4, vpp may be at most 2\)$")
    with pytest.raises(ValueError, match=expected):
        layout_rules.pipeline_parallel(12, 8, of="m", pp=4, vpp=3)
    with pytest.raises(ValueError, match=r"pp=16 stages of vpp=1 chunks each; pp alone exceeds the layers"):
        layout_rules.pipeline_parallel(16, 8, pp=16, vpp=1)


def test_without_pp_and_vpp_the_message_is_the_product_alone():
    with pytest.raises(ValueError, match=r"^n_chunks=5 \(pp·vpp\) must not exceed n_layers=4: every chunk "
                                         r"needs a layer$"):
        layout_rules.pipeline_parallel(5, 4)
    layout_rules.pipeline_parallel(8, 8, pp=4, vpp=2)  # exactly one layer per chunk is allowed


@pytest.mark.parametrize("kwargs, message", [
    (dict(pp=2), "give both pp and vpp or neither"),
    (dict(pp=2, vpp=3), r"n_chunks=4 must be pp·vpp = 2·3 = 6"),
    (dict(pp=4, vpp=0), "vpp must be at least 1, got 0"),
])
def test_inconsistent_pp_and_vpp_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        layout_rules.pipeline_parallel(4, 8, **kwargs)
