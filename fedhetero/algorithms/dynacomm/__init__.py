"""DynaComm: dynamic synchronisation points within local training, chosen per round by the
selectors in ``selection``."""
