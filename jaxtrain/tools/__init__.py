"""Command lines. Library modules never import these; each tool is a thin layer over the library."""
