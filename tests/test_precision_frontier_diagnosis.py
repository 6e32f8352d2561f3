"""The importance weights of the precision-frontier diagnosis (dllm_ais.experimental.precision_frontier_diagnosis)."""
import math

import torch

from dllm_ais.experimental.precision_frontier_diagnosis import truncated


def test_token_weights_are_truncated_ratios_on_the_completion():
    log_ratio = torch.tensor([[0.0, math.log(3.0), math.log(0.5)], [math.log(1.5), 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    weights = truncated(log_ratio, mask, "token", clip=2.0)
    assert torch.allclose(weights, torch.tensor([[1.0, 2.0, 0.5], [1.5, 0.0, 0.0]]))


def test_sequence_weights_are_the_truncated_product_on_every_token():
    log_ratio = torch.tensor([[math.log(0.5), math.log(0.8), 5.0], [math.log(3.0), math.log(1.0), 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])  # the masked 5.0 is not part of the product
    weights = truncated(log_ratio, mask, "sequence", clip=2.0)
    assert torch.allclose(weights, torch.tensor([[0.4, 0.4, 0.0], [2.0, 2.0, 2.0]]))
