"""The course handout: typst sources and the script that builds `handout.pdf` from them and the registry."""
