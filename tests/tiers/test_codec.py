"""The KV codec's copies out of chunk objects: one layer of several held objects at once
(``raw_layers``, the client's read of a layer of a request's chunks) against the one-by-one
reference (``object_layer``), bit for bit, each result its own memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.factories import make_key, make_object
from tiers.codec import object_layer, raw_layers
from tiers.format import FormatError, parse_header

pytestmark = pytest.mark.unit


def _objects(*shapes):
    out = []
    for i, (tokens, dtype) in enumerate(shapes):
        key = make_key(9900 + i)
        kv = torch.randn(3, 2, tokens, 2, 4).to(dtype)
        obj = np.frombuffer(make_object(key, kv), np.uint8)
        out.append((parse_header(obj, expected_key=key), obj, kv))
    return out


def test_raw_layers_equal_the_one_by_one_reference_and_are_each_their_own_memory():
    objs = _objects((5, torch.bfloat16), (9, torch.float32), (1, torch.float16))
    got = raw_layers([(h, 1, obj) for h, obj, _kv in objs])
    for t, (h, obj, kv) in zip(got, objs, strict=True):
        assert t.dtype == kv.dtype and torch.equal(t, kv[1])
        assert torch.equal(t, object_layer(h, 1, obj, checked=True))
    got[0].fill_(0)  # the engine writes into what it gets: nothing else changes
    assert torch.equal(got[1], objs[1][2][1]) and torch.equal(raw_layers([(objs[0][0], 1, objs[0][1])])[0],
                                                               objs[0][2][1])


def test_raw_layers_refuse_a_cut_object_or_a_compressed_layer():
    (h, obj, _kv), = _objects((5, torch.bfloat16))
    with pytest.raises(FormatError):
        raw_layers([(h, 2, obj[:h.layers[2].offset + 3])])
    lz4 = parse_header(make_object(make_key(9990), torch.zeros(3, 2, 64, 2, 4), compress=True))
    assert lz4.layers[0].codec != 0
    with pytest.raises(FormatError):
        raw_layers([(lz4, 0, np.zeros(lz4.total_bytes, np.uint8))])
