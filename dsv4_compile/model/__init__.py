"""Static-cache DeepSeek-V4 serving step built on a transformers model's weights."""
from .layout import StepLayout
from .step import DeepseekV4Step

__all__ = ["DeepseekV4Step", "StepLayout"]
