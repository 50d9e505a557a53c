"""Drafters: small classes that propose draft trees and observe what the target accepted."""
