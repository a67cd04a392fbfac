"""The shared layer: small pure modules every other layer may import (the driver, the ranks' runtime, the
trainer, the CLI). Standard library and PyYAML only: never torch, pandas or submitit."""
