"""Integrations of flashtile into other libraries, each an optional dependency.

Importing ``flashtile`` imports none of them; each integration module imports its
library only when it is used (``flashtile.integrations.transformers.register()``).
"""
