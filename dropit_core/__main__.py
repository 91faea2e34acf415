"""``python -m dropit_core``: print the README's DropIT-options tables, from the registry."""

from dropit_core.strategies.catalog import REGISTRY

print(REGISTRY.markdown())
