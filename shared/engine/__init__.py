"""The offline engine: scheduler, block manager, model runner, sampler, models."""
