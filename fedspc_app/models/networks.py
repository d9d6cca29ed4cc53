"""Model zoo for FedSPC and the split of each model into a shared body and a personal head.

Every model is trained from scratch (no pretrained weights are ever downloaded) and exposes
the timm classifier interface (``forward_features``, ``forward_head``, ``get_classifier``),
so that :func:`split_body_head` can find the head of any of them, and of a user's own model,
in the same way.

The models:

``cnn``
    The classic FedAvg CNN: two 5x5 convolutions (32 and 64 channels, no padding), each
    followed by ReLU and 2x2 max-pooling, a 512-unit fully connected layer with ReLU and the
    final linear classifier ``head``.
``cnn-bn``
    The same CNN with a BatchNorm layer after each convolution (``features.norm1``,
    ``features.norm2``): the smallest model with normalisation layers, for studying how
    they interact with the aggregation and the correction at a CPU budget.
``resnet34``
    timm's ResNet-34 with a CIFAR stem: the 7x7 stride-2 convolution becomes a 3x3 stride-1
    one and the stem max-pool is removed, so a 32x32 image is not shrunk to 1x1 by the last
    stage. The classifier is ``fc``. ``width`` (run-config ``model-width``) scales every
    stage's channels and the stem's, keeping the depth, the residuals and BatchNorm.
``resnet18``
    timm's ResNet-18 built the same way (the same blocks, stem, BatchNorm, widths and
    classifier, two blocks per stage instead of 3, 4, 6, 3): the depth between the CNN
    and ResNet-34, for asking whether an effect grows with depth.
``vgg11``
    A CIFAR-style VGG-11 with BatchNorm: the VGG-11 convolutional feature extractor, global
    average pooling to a 512-d feature and one ``Linear(512, num_classes)`` classifier
    ``head``. timm's ``VGG`` always builds its 4096-wide ``ConvMlp`` pre-logits (about 120 M
    parameters, over a second to initialise) before it could be swapped out, so the network
    is written here with the same layer layout (``features.<i>``) and initialisation.
    ``width`` scales every convolution's channels.
``vit``
    timm's ``VisionTransformer`` with patch size 4, 12 blocks and 12 heads, as in the paper;
    the classifier is ``head`` on the class token.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fedspc_app.core.config import MODEL_EXAMPLE, MODELS, WIDTH_MODELS, width_models_text
from fedspc_app.core.errors import ConfigError
from fedspc_app.core.named import import_named, is_named

__all__ = [
    "MODEL_NAMES",
    "CifarVGG11",
    "FedAvgCNN",
    "build_model",
    "split_body_head",
]

MODEL_NAMES: tuple[str, ...] = MODELS  # one list, in the run-config module

VGG11_CFG: tuple[int | str, ...] = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")
RESNET_CHANNELS = (64, 128, 256, 512)

VIT_PATCH_SIZE = 4
VIT_DEPTH = 12
VIT_NUM_HEADS = 12


class FedAvgCNN(nn.Module):
    """The two-layer CNN of the FedAvg paper (McMahan et al., 2017).

    Parameters
    ----------
    num_classes : int
        Number of output classes.
    in_chans : int
        Number of input channels.
    image_size : int
        Side of the square input images; fixes the input width of the 512-unit layer.
    batch_norm : bool
        Put a BatchNorm layer after each convolution (model ``cnn-bn``).

    Notes
    -----
    ``forward_features`` returns the feature map after the second pooling layer;
    ``forward_head`` flattens it and applies the 512-unit layer and the classifier ``head``.
    """

    hidden_size = 512

    def __init__(self, num_classes: int, in_chans: int = 3, image_size: int = 32,
                 batch_norm: bool = False) -> None:
        super().__init__()
        side = _cnn_feature_side(image_size)
        if side < 1:
            raise ConfigError(
                f"model 'cnn' needs image_size >= 16 (two 5x5 convolutions and two 2x2 "
                f"poolings), got {image_size}"
            )
        self.num_classes = num_classes
        self.in_chans = in_chans
        layers = []
        for i, (width_in, width) in enumerate(((in_chans, 32), (32, 64)), start=1):
            layers.append((f"conv{i}", nn.Conv2d(width_in, width, kernel_size=5)))
            if batch_norm:
                layers.append((f"norm{i}", nn.BatchNorm2d(width)))
            layers += [(f"act{i}", nn.ReLU(inplace=True)), (f"pool{i}", nn.MaxPool2d(2))]
        self.features = nn.Sequential(OrderedDict(layers))
        self.fc = nn.Linear(64 * side * side, self.hidden_size)
        self.act = nn.ReLU(inplace=True)
        self.num_features = self.hidden_size
        self.head = nn.Linear(self.hidden_size, num_classes)

    def get_classifier(self) -> nn.Module:
        """Return the final classification layer."""
        return self.head

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Convolutional feature map, shape ``[B, 64, s, s]``."""
        return self.features(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Map the feature map to logits, or to the 512-d feature if ``pre_logits``."""
        x = self.act(self.fc(torch.flatten(x, 1)))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits, shape ``[B, num_classes]``."""
        return self.forward_head(self.forward_features(x))


class CifarVGG11(nn.Module):
    """VGG-11 with BatchNorm and a single linear classifier, for 32x32 and larger images.

    Parameters
    ----------
    num_classes, in_chans : int
        Output classes and input channels.
    width : float
        Factor on every convolution's channels (default: 1.0, the standard VGG-11).

    Notes
    -----
    Body: ``features`` (eight 3x3 convolutions, each with BatchNorm and ReLU, five 2x2
    max-pools). Head: ``head = Linear(512, num_classes)`` on the globally average-pooled
    feature; at 32x32 the feature map is already 1x1, at 64x64 it is 2x2.
    """

    def __init__(self, num_classes: int, in_chans: int = 3, width: float = 1.0) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.in_chans = in_chans
        layers: list[nn.Module] = []
        prev = in_chans
        for v in VGG11_CFG:
            if v == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                assert isinstance(v, int)
                v = scale_channels("vgg11", (v,), width)[0]
                layers += [
                    nn.Conv2d(prev, v, kernel_size=3, padding=1),
                    nn.BatchNorm2d(v),
                    nn.ReLU(inplace=True),
                ]
                prev = v
        self.features = nn.Sequential(*layers)
        self.num_features = prev
        self.global_pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(prev, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        # Same scheme as timm's and torchvision's VGG.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.01)
                nn.init.zeros_(m.bias)

    def get_classifier(self) -> nn.Module:
        """Return the final classification layer."""
        return self.head

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Convolutional feature map, shape ``[B, 512 * width, H/32, W/32]``."""
        return self.features(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Pool the feature map and return logits, or the pooled feature if ``pre_logits``."""
        x = torch.flatten(self.global_pool(x), 1)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits, shape ``[B, num_classes]``."""
        return self.forward_head(self.forward_features(x))


def _cnn_feature_side(image_size: int) -> int:
    side = (image_size - 4) // 2
    return (side - 4) // 2


def scale_channels(model: str, channels: tuple[int, ...], width: float) -> tuple[int, ...]:
    """``channels`` times ``width``, rounded; ConfigError if a layer would have none."""
    scaled = tuple(round(c * width) for c in channels)
    if min(scaled) < 1:
        raise ConfigError(
            f"model-width {width:g} leaves a layer of {model} with no channels "
            f"({channels} become {scaled})")
    return scaled


def _build_cnn(num_classes: int, in_chans: int, image_size: int, **_: Any) -> nn.Module:
    return FedAvgCNN(num_classes=num_classes, in_chans=in_chans, image_size=image_size)


def _build_cnn_bn(num_classes: int, in_chans: int, image_size: int, **_: Any) -> nn.Module:
    return FedAvgCNN(num_classes=num_classes, in_chans=in_chans, image_size=image_size,
                     batch_norm=True)


def _build_resnet(arch: str, num_classes: int, in_chans: int, image_size: int, *,
                  width: float = 1.0, **_: Any) -> nn.Module:
    """timm's ``arch`` (``resnet18`` or ``resnet34``) with the CIFAR stem, ``width`` wide."""
    import timm  # imported when needed: it takes about 1.5 s (torchvision, dynamo)

    channels = scale_channels(arch, RESNET_CHANNELS, width)
    model = timm.create_model(
        arch, pretrained=False, num_classes=num_classes, in_chans=in_chans,
        channels=channels,
    )
    stem_out = model.conv1.out_channels
    if width != 1.0:
        # timm's plain stem is always 64 wide: narrow it with the stages, and give the
        # first block the input timm would have built for a stem of that width (a 3x3
        # convolution from the stem, no projection shortcut).
        stem_out = channels[0]
        model.bn1 = nn.BatchNorm2d(stem_out)
        first = model.layer1[0]
        first.conv1 = nn.Conv2d(stem_out, channels[0], kernel_size=3, stride=1, padding=1,
                                bias=False)
        nn.init.kaiming_normal_(first.conv1.weight, mode="fan_out", nonlinearity="relu")
        first.downsample = None
        model.feature_info[0]["num_chs"] = stem_out
    model.conv1 = nn.Conv2d(in_chans, stem_out, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    model.maxpool = nn.Identity()
    # The stem no longer downsamples by 4, so keep timm's feature metadata truthful.
    for info in model.feature_info:
        info["reduction"] = max(1, info["reduction"] // 4)
    return model


def _build_vgg11(num_classes: int, in_chans: int, image_size: int, *, width: float = 1.0,
                 **_: Any) -> nn.Module:
    if image_size < 32:
        raise ConfigError(
            f"model 'vgg11' needs image_size >= 32 (five 2x2 max-pools), got {image_size}"
        )
    return CifarVGG11(num_classes=num_classes, in_chans=in_chans, width=width)


def _build_vit(num_classes: int, in_chans: int, image_size: int, *, vit_embed_dim: int = 768,
               **_: Any) -> nn.Module:
    if not _is_positive_int(vit_embed_dim) or vit_embed_dim % VIT_NUM_HEADS != 0:
        raise ConfigError(
            f"vit_embed_dim must be a positive multiple of {VIT_NUM_HEADS} (the number of "
            f"attention heads), got {vit_embed_dim!r}"
        )
    if image_size % VIT_PATCH_SIZE != 0:
        raise ConfigError(
            f"model 'vit' needs image_size divisible by the patch size {VIT_PATCH_SIZE}, "
            f"got {image_size}"
        )
    from timm.models.vision_transformer import VisionTransformer  # see _build_resnet

    return VisionTransformer(
        img_size=image_size,
        patch_size=VIT_PATCH_SIZE,
        in_chans=in_chans,
        num_classes=num_classes,
        embed_dim=vit_embed_dim,
        depth=VIT_DEPTH,
        num_heads=VIT_NUM_HEADS,
    )


_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "cnn": _build_cnn,
    "cnn-bn": _build_cnn_bn,
    "resnet18": functools.partial(_build_resnet, "resnet18"),
    "resnet34": functools.partial(_build_resnet, "resnet34"),
    "vgg11": _build_vgg11,
    "vit": _build_vit,
}


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def build_model(
    name: str,
    *,
    num_classes: int,
    in_chans: int = 3,
    image_size: int = 32,
    seed: int | None = None,
    vit_embed_dim: int = 768,
    width: float = 1.0,
) -> nn.Module:
    """A freshly initialised (never pretrained) CPU model in training mode whose
    ``model(x)`` returns logits and whose ``get_classifier()`` is its final layer.

    ``name`` is one of :data:`MODEL_NAMES`, or ``"package.module:function"`` for a
    model of the user's own (:func:`custom_builder`). With ``seed`` the initial
    weights are a function of it alone (every client of a run starts from the same
    model; a model of one's own too, when it draws its initial weights from torch's
    default generator, as torch's layers do) and the global torch RNG is left as it
    was.
    ``vit_embed_dim`` (a multiple of the 12 heads) is used by ``vit`` only; ``width``
    scales the channels of the ResNets and ``vgg11`` and must be 1.0 for the others.
    Raises ConfigError for an unknown name or an impossible option.
    """
    if is_named(name):
        builder = custom_builder(name)
    elif name in _BUILDERS:
        builder = _BUILDERS[name]
    else:
        raise ConfigError(
            f"unknown model {name!r}; valid names are: {', '.join(MODEL_NAMES)}, or "
            "'package.module:function' for a model of your own"
        )
    for option, value in (
        ("num_classes", num_classes),
        ("in_chans", in_chans),
        ("image_size", image_size),
    ):
        if not _is_positive_int(value):
            raise ConfigError(f"{option} must be a positive integer, got {value!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ConfigError(f"seed must be an integer or None, got {seed!r}")
    if not width > 0 or (width != 1.0 and name not in WIDTH_MODELS):
        raise ConfigError(f"width {width!r} is not a width of model {name!r} (a positive "
                          f"factor, for {width_models_text()} only)")

    options = dict(vit_embed_dim=vit_embed_dim, width=width)
    if seed is None:
        return builder(num_classes, in_chans, image_size, **options)
    # Models are built on the CPU, so forking and seeding only the CPU generator makes the
    # weights reproducible without touching any CUDA generator or the caller's RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return builder(num_classes, in_chans, image_size, **options)


def custom_builder(name: str) -> Callable[..., nn.Module]:
    """The builder of a model of the user's own, run-config ``model =
    "package.module:function"`` (:mod:`fedspc_app.core.named`):
    ``function(num_classes=, in_chans=, image_size=)`` must return an ``nn.Module``
    whose ``model(x)`` gives logits and whose ``get_classifier()`` is its final layer
    (:func:`split_body_head`). Raises ConfigError, naming the module or the function,
    when it cannot be imported or is no function."""
    make = import_named("model", name, MODEL_EXAMPLE)
    if not callable(make):
        raise ConfigError(f"run-config 'model' = {name!r}: {name.partition(':')[2]} is "
                          "not a function")

    def build(num_classes: int, in_chans: int, image_size: int, **_: Any) -> nn.Module:
        model = make(num_classes=num_classes, in_chans=in_chans, image_size=image_size)
        if not isinstance(model, nn.Module):
            raise ConfigError(f"run-config 'model' = {name!r}: it returned "
                              f"{type(model).__name__}, not a torch.nn.Module")
        return model.cpu().train()

    return build


def split_body_head(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Split the state_dict keys of a model into its shared body and its personal head.

    The head is the module returned by ``model.get_classifier()``, located by identity among
    ``model.named_modules()``; every other state_dict entry, buffers included (e.g. BatchNorm
    running statistics), belongs to the body.

    Parameters
    ----------
    model : torch.nn.Module
        A model defining ``get_classifier()`` that returns its final classification layer,
        a submodule holding at least one parameter or buffer.

    Returns
    -------
    tuple of (tuple of str, tuple of str)
        ``(body_keys, head_keys)``, each in state_dict order; disjoint, and together they
        cover every state_dict key exactly once.

    Raises
    ------
    ConfigError
        If the model has no ``get_classifier()``, the classifier is not a proper submodule of
        the model, holds no state, or would leave the body empty.
    """
    model_type = type(model).__name__
    get_classifier = getattr(model, "get_classifier", None)
    if not callable(get_classifier):
        raise ConfigError(
            f"cannot split model {model_type} into body and head: it has no get_classifier(); "
            f"define get_classifier() returning the final classification layer "
            f"(e.g. `def get_classifier(self): return self.fc`)"
        )
    classifier = get_classifier()
    if not isinstance(classifier, nn.Module):
        raise ConfigError(
            f"{model_type}.get_classifier() returned {type(classifier).__name__}, not an "
            f"nn.Module; define get_classifier() returning the final classification layer"
        )
    # A module registered under several names appears under each of them in the state_dict.
    head_names = [
        name
        for name, module in model.named_modules(remove_duplicate=False)
        if module is classifier
    ]
    if not head_names:
        raise ConfigError(
            f"{model_type}.get_classifier() returned a {type(classifier).__name__} that is not "
            f"a submodule of the model; define get_classifier() returning the final "
            f"classification layer held by the model"
        )
    if "" in head_names:
        raise ConfigError(
            f"{model_type}.get_classifier() returned the model itself, which would leave the "
            f"body empty; define get_classifier() returning only the final classification layer"
        )
    local_keys = list(classifier.state_dict().keys())
    if not local_keys:
        raise ConfigError(
            f"{model_type}.get_classifier() returned a {type(classifier).__name__} with no "
            f"parameters or buffers (was the model built with num_classes=0?); define "
            f"get_classifier() returning the final classification layer"
        )
    head_set = {f"{name}.{key}" for name in head_names for key in local_keys}
    all_keys = list(model.state_dict().keys())
    head_keys = tuple(k for k in all_keys if k in head_set)
    body_keys = tuple(k for k in all_keys if k not in head_set)
    if not body_keys:
        raise ConfigError(
            f"model {model_type} has no state outside get_classifier(), so there is no body "
            f"to share; the classifier must be only the final classification layer"
        )
    return body_keys, head_keys
