"""The xqa route: its kernel (:mod:`.kernel`) and its launcher with the settings it picks (:mod:`.launch`)."""
