"""The offline engine: scheduler, block manager, model runner, sampler, models and their weight loader."""
