"""Store backends; each module registers its class with `hetserve.store.registry`."""
