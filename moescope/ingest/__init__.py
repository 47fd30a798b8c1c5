"""Other engines' routing into a moescope store: importers of their dumps and a live proxy."""
