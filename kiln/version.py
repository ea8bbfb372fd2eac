"""Version of kiln (one definition; the package, engine files and build info read it)."""

__version__ = "0.1.0"
