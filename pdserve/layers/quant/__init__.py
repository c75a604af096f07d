"""How a linear layer holds and multiplies its weights. A QuantConfig (none: full precision)
hands each layer a QuantMethod when the layer is built; the method creates the layer's
parameters, loads checkpoint tensors into them and does the matmul. See base.py."""
from pdserve.layers.quant.base import QuantConfig, QuantMethod
from pdserve.layers.quant.unquantized import UnquantizedConfig, UnquantizedLinearMethod

__all__ = ["QuantConfig", "QuantMethod", "UnquantizedConfig", "UnquantizedLinearMethod"]
