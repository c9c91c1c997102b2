"""nn.Modules and weight loading for the models Tandem serves."""
