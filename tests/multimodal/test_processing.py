"""Placeholder expansion: one placeholder token per image becomes the image's embeddings' count."""

from __future__ import annotations

import pytest

from multimodal.processing import expand_placeholders

P = 9   # placeholder token id


@pytest.mark.parametrize("ids,lengths,expanded,offsets", [
    ([1, P, 2], [3], [1, P, P, P, 2], [1]),                                   # one image
    ([P, 1, P], [2, 3], [P, P, 1, P, P, P], [0, 3]),                          # two, text between
    ([1, P, P, P, 2], [3], [1, P, P, P, 2], [1]),                             # already expanded
    ([P, P, P, P, P], [2, 3], [P, P, P, P, P], [0, 2]),                       # two expanded back to back
    ([1, P, P, 2], [3, 2], [1, P, P, P, P, P, 2], [1, 4]),                    # <image><image>: two images
])
def test_expand(ids, lengths, expanded, offsets):
    assert expand_placeholders(ids, P, lengths) == (expanded, offsets)


@pytest.mark.parametrize("ids,lengths,match", [
    ([1, 2], [3], "0 image placeholder"),
    ([P, 1, P], [3], "2 image placeholder"),
    ([1, P, P, P, P], [3], "does not match"),          # a run of 4 for one image of 3
])
def test_mismatch_is_a_user_error(ids, lengths, match):
    with pytest.raises(ValueError, match=match):
        expand_placeholders(ids, P, lengths)
