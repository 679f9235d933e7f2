"""A run folder's life: its files named and written (:mod:`~nobubble.runfolder.folder`), read by
every command in one place (:mod:`~nobubble.runfolder.reading`)."""
