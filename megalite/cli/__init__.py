"""The command-line side: arguments generated from the configs, the feature rule engine,
validation, Megatron compat flags, recipes and presets, and the user-error boundary."""
