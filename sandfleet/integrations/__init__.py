"""Adapters that let clients written for other sandbox platforms drive sandfleet unchanged.

Each module speaks one client's interfaces on top of the SDK and stands behind an extra of its
own (`pip install 'sandfleet[swerex]'`), so `import sandfleet` stays light: importing a module
whose extra is missing raises `sandfleet.extras.MissingExtra` saying what to install.
"""
