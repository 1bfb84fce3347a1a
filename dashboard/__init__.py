"""The Streamlit dashboard for SREs and finance."""
