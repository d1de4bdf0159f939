"""File formats read and written alike by the SDK and the node: pure Python over file
descriptors the caller opened, importing nothing of ours (a ground floor, as schemas/ is)."""
