"""Single-device model definitions, built by name from a registry.

Model code here knows nothing of parallelism (as in torchtitan): spatial,
pipeline and data parallelism are applied to these models by functions in
:mod:`hyfi_imaging.parallel`. To make that possible every model

- is built only from pixel-mixing *modules* (Conv2d, MaxPool2d, AvgPool2d,
  BatchNorm2d, AdaptiveAvgPool2d, ConvTranspose2d) plus pointwise code and the
  pads and interpolations that have a spatial form, so ``spatialize()`` can
  swap them for halo-exchanging twins;
- offers ``set_grad_checkpointing``, ``num_classes``, ``in_chans`` and
  ``total_stride`` (:class:`ModelBase`).

The classifiers and regressors (ResNet, ResNet-v2, AmoebaNet, ConvChain,
CosmoFlow) are moreover chains (:class:`ChainModel`): running their ordered
top-level children equals ``forward``, so pipeline stages are slices of
``list(model.children())``, and they offer ``forward_features``,
``forward_head`` and ``num_features``. The U-Nets (``unet2d``, ``unet3d``)
give dense per-pixel output and run as one stage. The 3-D models (``unet3d``,
``cosmoflow``) run in one process until the spatial engine tiles volumes.

Importing this package registers every variant; see :func:`list_models`.
"""

from __future__ import annotations

from hyfi_imaging.models.amoebanet import AMOEBANET_D, AmoebaNet, FactorizedReduce, Genotype
from hyfi_imaging.models.convchain import ConvChain, ConvReLU
from hyfi_imaging.models.cosmoflow import CosmoFlow, CosmoFlowBlock, ScaledTanh
from hyfi_imaging.models.registry import (
    ChainModel,
    CheckpointedBlock,
    ModelBase,
    create_model,
    list_models,
    register_model,
)
from hyfi_imaging.models.resnet import BasicBlock, Bottleneck, ResNet
from hyfi_imaging.models.resnet_v2 import PreActBlock, ResNetV2
from hyfi_imaging.models.unet import DoubleConv, UNet, UpConcat

__all__ = [
    "AMOEBANET_D",
    "AmoebaNet",
    "BasicBlock",
    "Bottleneck",
    "ChainModel",
    "CheckpointedBlock",
    "ConvChain",
    "ConvReLU",
    "CosmoFlow",
    "CosmoFlowBlock",
    "DoubleConv",
    "FactorizedReduce",
    "Genotype",
    "ModelBase",
    "PreActBlock",
    "ResNet",
    "ResNetV2",
    "ScaledTanh",
    "UNet",
    "UpConcat",
    "create_model",
    "list_models",
    "register_model",
]
