"""whisper: fine-tune Whisper with any exogym strategy.

Convert the CTranslate2 tiny.en weights to a transformers model, synthesize
speech, wrap the model for exogym, LoRA adapters, and the task itself. May
import exogym only.
"""
