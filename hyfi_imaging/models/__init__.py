"""Single-device model definitions, built by name from a registry.

Model code here knows nothing of parallelism (as in torchtitan): spatial,
pipeline and data parallelism are applied to these models by functions in
:mod:`hyfi_imaging.parallel`. To make that possible every model

- is built only from pixel-mixing *modules* (Conv2d, MaxPool2d, AvgPool2d,
  BatchNorm2d, AdaptiveAvgPool2d) plus pointwise code, so ``spatialize()``
  can swap them for halo-exchanging twins;
- is its ordered top-level children: running them in order equals
  ``forward``, so pipeline stages are slices of ``list(model.children())``;
- offers ``forward_features``, ``forward_head``, ``set_grad_checkpointing``,
  ``num_classes``, ``in_chans``, ``num_features`` and ``total_stride``.

Importing this package registers every variant; see :func:`list_models`.
"""

from __future__ import annotations

from hyfi_imaging.models.amoebanet import AMOEBANET_D, AmoebaNet, FactorizedReduce, Genotype
from hyfi_imaging.models.convchain import ConvChain, ConvReLU
from hyfi_imaging.models.registry import (
    ChainModel,
    CheckpointedBlock,
    create_model,
    list_models,
    register_model,
)
from hyfi_imaging.models.resnet import BasicBlock, Bottleneck, ResNet
from hyfi_imaging.models.resnet_v2 import PreActBlock, ResNetV2

__all__ = [
    "AMOEBANET_D",
    "AmoebaNet",
    "BasicBlock",
    "Bottleneck",
    "ChainModel",
    "CheckpointedBlock",
    "ConvChain",
    "ConvReLU",
    "FactorizedReduce",
    "Genotype",
    "PreActBlock",
    "ResNet",
    "ResNetV2",
    "create_model",
    "list_models",
    "register_model",
]
